//! Priority levels and fairness groups.

use super::*;

use Priority::{Background, Live};

/// Hands out `n` items without waiting for more.
async fn take(q: &WorkQueue<String>, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..n {
        match try_get(q, MS).await {
            Some(item) => out.push(item),
            None => break,
        }
    }
    out
}

fn by_namespace() -> WorkQueue<String> {
    WorkQueue::with_config(
        WorkQueueConfig::new()
            .fairness(|key: &String| key.split_once('/').map_or("", |(ns, _)| ns).to_string()),
    )
}

#[tokio::test(start_paused = true)]
async fn live_items_are_handed_out_before_background_ones() {
    let q = queue();
    q.add_with_priority(s("listed-1"), Background);
    q.add_with_priority(s("listed-2"), Background);
    q.add(s("changed-1"));
    q.add_with_priority(s("changed-2"), Live);
    let m = q.metrics();
    assert_eq!((q.len(), m.depth, m.background_depth), (4, 4, 2));
    assert_eq!(
        take(&q, 5).await,
        ["changed-1", "changed-2", "listed-1", "listed-2"]
    );
    assert_eq!(q.metrics().background_depth, 0);
}

#[tokio::test(start_paused = true)]
async fn background_item_added_as_live_moves_up_once_and_keeps_its_add_time() {
    let q = queue();
    for key in ["a", "b", "c"] {
        q.add_with_priority(s(key), Background);
    }
    advance(Duration::from_secs(5)).await;
    q.add(s("b"));
    q.add(s("b"));
    let m = q.metrics();
    assert_eq!((q.len(), m.background_depth, m.adds), (3, 2, 3));

    assert_eq!(q.get().await, Some(s("b")));
    assert_eq!(q.metrics().queue_latency_total, Duration::from_secs(5));
    assert_eq!(q.len(), 2);
    // Its stale Background entry is skipped: "b" is not handed out a second time.
    assert_eq!(take(&q, 5).await, ["a", "c"]);
    assert_eq!(q.len(), 0);
    let state = q.inner.lock();
    assert_eq!(
        (state.waiting.groups(Live), state.waiting.groups(Background)),
        (0, 0),
        "nothing is left behind once the stale entries are reached"
    );
}

#[tokio::test(start_paused = true)]
async fn live_item_added_as_background_stays_live() {
    let q = queue();
    q.add(s("a"));
    q.add_with_priority(s("b"), Background);
    q.add_with_priority(s("a"), Background);
    assert_eq!((q.len(), q.metrics().background_depth), (2, 1));
    assert_eq!(take(&q, 3).await, ["a", "b"]);
}

#[tokio::test(start_paused = true)]
async fn processing_item_is_requeued_at_the_highest_priority_it_was_added_with() {
    let q = queue();
    q.add_with_priority(s("x"), Background);
    q.add_with_priority(s("y"), Background);
    assert_eq!(q.get().await, Some(s("x")));
    assert_eq!(q.get().await, Some(s("y")));
    q.add_with_priority(s("x"), Background);
    q.add(s("x"));
    q.add_with_priority(s("x"), Background);
    q.add_with_priority(s("y"), Background);
    q.add_with_priority(s("z"), Background);
    assert_eq!(q.len(), 1);

    q.done(&s("y"));
    q.done(&s("x"));
    assert_eq!((q.len(), q.metrics().background_depth), (3, 2));
    // "x" was added as Live while processing; "y" only as Background.
    assert_eq!(take(&q, 4).await, ["x", "z", "y"]);
}

#[tokio::test(start_paused = true)]
async fn bumps_never_hand_out_an_item_twice_and_len_counts_current_entries() {
    let q = queue();
    for i in 0..100 {
        q.add_with_priority(format!("k{i}"), Background);
    }
    for i in (0..100).step_by(2) {
        q.add(format!("k{i}"));
        q.add_with_priority(format!("k{i}"), Background);
    }
    let m = q.metrics();
    assert_eq!((q.len(), m.background_depth, m.adds), (100, 50, 100));

    let mut seen = HashSet::new();
    let mut handed_out = 0;
    while let Some(item) = try_get(&q, MS).await {
        handed_out += 1;
        assert!(seen.insert(item.clone()), "{item} handed out twice");
        assert_eq!(q.len(), 100 - handed_out);
        // Bumping an item that is processing changes nothing that is waiting.
        q.add(item.clone());
        assert_eq!(q.len(), 100 - handed_out);
    }
    assert_eq!(seen.len(), 100);
    assert_eq!(q.len(), 0);
}

#[tokio::test(start_paused = true)]
async fn background_gets_a_turn_under_a_continuous_live_stream() {
    let q = queue();
    for i in 0..10 {
        q.add_with_priority(format!("listed-{i}"), Background);
    }
    let mut order = Vec::new();
    for i in 0..45 {
        // A new live change arrives before every hand-out, so Live items always wait.
        q.add(format!("changed-{i}"));
        order.push(q.get().await.unwrap());
    }
    let background: Vec<usize> = order
        .iter()
        .enumerate()
        .filter(|(_, key)| key.starts_with("listed-"))
        .map(|(at, _)| at)
        .collect();
    // 8 Live hand-outs, then 1 Background, and again.
    assert_eq!(background, [8, 17, 26, 35, 44]);
    assert_eq!(order[8], "listed-0");
    assert_eq!(order[17], "listed-1");
}

#[tokio::test(start_paused = true)]
async fn live_burst_is_configurable_and_at_least_one() {
    for (burst, expected) in [
        (1, vec!["l0", "b0", "l1", "b1", "l2"]),
        (0, vec!["l0", "b0", "l1", "b1", "l2"]),
        (3, vec!["l0", "l1", "l2", "b0", "l3"]),
    ] {
        let q: WorkQueue<String> = WorkQueue::with_config(WorkQueueConfig::new().live_burst(burst));
        q.add_with_priority(s("b0"), Background);
        q.add_with_priority(s("b1"), Background);
        for i in 0..5 {
            q.add(format!("l{i}"));
        }
        assert_eq!(take(&q, 5).await, expected, "live_burst({burst})");
    }
}

#[tokio::test(start_paused = true)]
async fn background_item_added_while_no_live_waits_a_full_burst() {
    // Live items handed out while no Background item waited do not count towards the burst.
    let q = queue();
    for i in 0..20 {
        q.add(format!("l{i}"));
    }
    take(&q, 10).await;
    q.add_with_priority(s("b"), Background);
    let order = take(&q, 10).await;
    assert_eq!(order.iter().position(|k| k == "b"), Some(8));
}

#[tokio::test(start_paused = true)]
async fn fairness_takes_turns_between_groups_in_arrival_order() {
    let q = by_namespace();
    for key in ["a/1", "a/2", "a/3", "b/1", "b/2", "c/1"] {
        q.add(s(key));
    }
    assert_eq!(
        take(&q, 7).await,
        ["a/1", "b/1", "c/1", "a/2", "b/2", "a/3"]
    );
    let state = q.inner.lock();
    assert_eq!(state.waiting.groups(Live), 0, "empty groups are removed");
}

#[tokio::test(start_paused = true)]
async fn a_group_backlog_delays_another_group_by_at_most_one_turn() {
    let q = by_namespace();
    for i in 0..1000 {
        q.add(format!("busy/{i}"));
    }
    take(&q, 10).await;
    q.add(s("quiet/1"));
    assert_eq!(take(&q, 2).await, ["busy/10", "quiet/1"]);
    // The quiet group left with its only item; it is not kept around.
    assert_eq!(q.inner.lock().waiting.groups(Live), 1);
    q.add(s("quiet/2"));
    assert_eq!(take(&q, 2).await, ["busy/11", "quiet/2"]);

    // The same without fairness: the quiet key waits behind the whole backlog.
    let fifo = queue();
    for i in 0..1000 {
        fifo.add(format!("busy/{i}"));
    }
    fifo.add(s("quiet/1"));
    let order = take(&fifo, 1001).await;
    assert_eq!(order.iter().position(|k| k == "quiet/1"), Some(1000));
}

#[tokio::test(start_paused = true)]
async fn fairness_applies_within_each_level() {
    let q = by_namespace();
    q.add_with_priority(s("a/listed"), Background);
    q.add_with_priority(s("b/listed"), Background);
    q.add(s("a/1"));
    q.add(s("a/2"));
    q.add(s("b/1"));
    // Moving up puts "b/listed" at the back of group b in the Live level.
    q.add(s("b/listed"));
    assert_eq!((q.len(), q.metrics().background_depth), (5, 1));
    assert_eq!(
        take(&q, 6).await,
        ["a/1", "b/1", "a/2", "b/listed", "a/listed"]
    );
}

#[tokio::test(start_paused = true)]
async fn shut_down_with_drain_hands_out_both_levels() {
    let q = queue();
    q.add_with_priority(s("p"), Background);
    assert_eq!(q.get().await, Some(s("p")));
    q.add_with_priority(s("p"), Background);
    q.add_with_priority(s("listed"), Background);
    q.add(s("changed"));

    let drain = tokio::spawn({
        let q = q.clone();
        async move { q.shut_down_with_drain().await }
    });
    settle().await;
    assert!(!drain.is_finished());
    // Adds after shutdown are ignored at every level, bumps included.
    q.add_with_priority(s("late"), Background);
    q.add(s("listed"));
    assert_eq!((q.len(), q.metrics().background_depth), (2, 1));

    assert_eq!(q.get().await, Some(s("changed")));
    assert_eq!(q.get().await, Some(s("listed")));
    q.done(&s("changed"));
    q.done(&s("listed"));
    q.done(&s("p"));
    // "p" was dirtied before the shutdown: queued again, as Background.
    assert_eq!((q.len(), q.metrics().background_depth), (1, 1));
    settle().await;
    assert!(!drain.is_finished());
    assert_eq!(q.get().await, Some(s("p")));
    q.done(&s("p"));
    settle().await;
    assert!(drain.is_finished());
    assert_eq!(q.get().await, None);
}
