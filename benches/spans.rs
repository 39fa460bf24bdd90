//! Host time by span: a minimal `tracing` subscriber that adds up, per span name, the time
//! between entering and leaving each span of the library (its `debug` spans: `propose`,
//! `propose_prepare`, `graph_inputs`, `graph_replay`, `propose_readback`, …), so a benchmark can
//! say where a phase's wall time goes on the host. Spans nest: a parent's time includes its
//! children's. Warnings and errors are printed to stderr, as the benchmarks' default would.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// An event's fields as ` name=value` pairs (the message bare).
struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0.push_str(&format!(" {value:?}"));
        } else {
            self.0.push_str(&format!(" {}={value:?}", field.name()));
        }
    }
}

/// Calls and total time per span name.
type Totals = BTreeMap<&'static str, (u64, Duration)>;

#[derive(Default)]
struct State {
    /// Name and the time of the open entry, per live span.
    live: HashMap<u64, (&'static str, Option<Instant>)>,
    totals: Totals,
}

/// The collected times; [`SpanTimes::install`] makes a clone the global subscriber.
#[derive(Clone, Default)]
pub struct SpanTimes {
    state: Arc<Mutex<State>>,
    next: Arc<AtomicU64>,
    /// Whether spans are timed (else only warnings are printed).
    spans: bool,
}

impl Subscriber for SpanTimes {
    fn enabled(&self, meta: &Metadata<'_>) -> bool {
        if meta.is_event() {
            return *meta.level() <= tracing::Level::WARN;
        }
        self.spans
            && meta.is_span()
            && meta.target().starts_with("dspark")
            && *meta.level() <= tracing::Level::DEBUG
    }

    fn new_span(&self, attrs: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        if let Ok(mut s) = self.state.lock() {
            s.live.insert(id, (attrs.metadata().name(), None));
        }
        Id::from_u64(id)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        let meta = event.metadata();
        eprintln!("{} {}:{}", meta.level(), meta.target(), fields.0);
    }

    fn enter(&self, id: &Id) {
        if let Ok(mut s) = self.state.lock()
            && let Some(entry) = s.live.get_mut(&id.into_u64())
        {
            entry.1 = Some(Instant::now());
        }
    }

    fn exit(&self, id: &Id) {
        if let Ok(mut s) = self.state.lock()
            && let Some((name, Some(t))) = s.live.get_mut(&id.into_u64()).map(|e| (e.0, e.1.take()))
        {
            let e = s.totals.entry(name).or_default();
            e.0 += 1;
            e.1 += t.elapsed();
        }
    }

    fn try_close(&self, id: Id) -> bool {
        if let Ok(mut s) = self.state.lock() {
            s.live.remove(&id.into_u64());
        }
        true
    }
}

impl SpanTimes {
    /// Install as the global subscriber, timing spans when `spans` is set. `None` when one is
    /// already installed.
    pub fn install(spans: bool) -> Option<Self> {
        let times = Self { spans, ..Self::default() };
        tracing::subscriber::set_global_default(times.clone()).ok().map(|()| times)
    }

    /// Forget what was collected.
    pub fn reset(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.totals.clear();
        }
    }

    /// A markdown table of each span's calls and µs per run, over `runs` runs of a phase.
    pub fn table(&self, title: &str, runs: usize) -> String {
        let totals = self.state.lock().map(|s| s.totals.clone()).unwrap_or_default();
        let mut out = format!(
            "### host time by span: {title} (mean of {runs} runs)\n\n| span | calls per run | µs per run |\n|---|---|---|\n"
        );
        for (name, (calls, total)) in totals {
            out.push_str(&format!(
                "| `{name}` | {:.1} | {:.1} |\n",
                calls as f64 / runs as f64,
                total.as_secs_f64() * 1e6 / runs as f64
            ));
        }
        out
    }
}
