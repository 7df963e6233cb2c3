//! Helpers every floor of the crate shares, at the bottom so that nothing imports upward to
//! reach them.

/// Locks `m` even if a panic poisoned it: the data behind the crate's locks stays consistent
/// across a panic (a handler's or an index function's panic is caught and reported), so one
/// panic must not turn every later access into another.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a caught panic said: its message, when it is a string.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}
