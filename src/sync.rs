//! Helpers every floor of the crate shares, at the bottom so that nothing imports upward to
//! reach them.

/// Locks `m` even if a panic poisoned it: the data behind the crate's locks stays consistent
/// across a panic (a handler's or an index function's panic is caught and reported), so one
/// panic must not turn every later access into another.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
