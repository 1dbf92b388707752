"""Chrome / Perfetto trace of a simulated step (the Trace Event Format's JSON object form).

Format: Google's "Trace Event Format" document, as read by chrome://tracing and ui.perfetto.dev.
Every device is one track (thread) of the process "devices"; every link that carries a transfer
is one track of the process "links". Each forward, backward and send is a complete ("ph": "X")
event with a start ("ts") and duration ("dur") in microseconds; "M" events name the tracks; "C"
(counter) events draw each device's memory over the step.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from planner.report.events import TimedEvent, event_label

DEVICES_PID = 1
LINKS_PID = 2
_US_PER_S = 1e6


def chrome_trace(
    events: Sequence[TimedEvent],
    device_tracks: Sequence[str],
    link_tracks: Sequence[str],
    labels: Mapping[str, str] | None = None,
    title: str = "planner",
    memory: Mapping[str, Sequence[tuple[float, int]]] | None = None,
) -> dict[str, Any]:
    """Build the trace object; ``labels`` maps a track's resource id to the name shown for it.

    ``memory`` (device -> ``(time_s, bytes)`` samples, see ``events.memory_timeline``) adds one
    counter track per device, "memory DEVICE", to the devices process.
    """
    labels = labels or {}
    tid = {name: i + 1 for i, name in enumerate(device_tracks)}
    tid.update({name: i + 1 for i, name in enumerate(link_tracks)})
    pid = {**{name: DEVICES_PID for name in device_tracks}, **{name: LINKS_PID for name in link_tracks}}
    trace: list[dict[str, Any]] = _metadata(device_tracks, link_tracks, labels, title)
    for ev in sorted(events, key=lambda e: (e.start_s, e.resource, e.kind, e.stage, e.microbatch)):
        if ev.resource not in tid:
            raise ValueError(f"event on unknown track {ev.resource!r}")
        trace.append({
            "ph": "X",
            "name": event_label(ev),
            "cat": ev.kind,
            "pid": pid[ev.resource],
            "tid": tid[ev.resource],
            "ts": round(ev.start_s * _US_PER_S, 3),
            "dur": round(max(0.0, ev.end_s - ev.start_s) * _US_PER_S, 3),
            "args": {"stage": ev.stage, "microbatch": ev.microbatch, "kind": ev.kind},
        })
    for device, samples in (memory or {}).items():
        name = f"memory {labels.get(device, device)}"
        trace.extend({"ph": "C", "name": name, "pid": DEVICES_PID, "tid": 0, "ts": round(t * _US_PER_S, 3),
                      "args": {"bytes": level}} for t, level in samples)
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {"title": title}}


def _metadata(devices: Sequence[str], links: Sequence[str], labels: Mapping[str, str], title: str) -> list[dict[str, Any]]:
    meta: list[dict[str, Any]] = []
    for pid, process, names in ((DEVICES_PID, f"{title}: devices", devices), (LINKS_PID, f"{title}: links", links)):
        if not names:
            continue
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for i, name in enumerate(names):
            meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": i + 1, "args": {"name": labels.get(name, name)}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": i + 1, "args": {"sort_index": i + 1}})
    return meta
