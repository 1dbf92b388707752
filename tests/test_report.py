"""The plan report: stage table, timeline picture (PNG, SVG) and Chrome/Perfetto trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from planner.errors import PlannerError
from planner.formats.plan import plan_from_dict
from planner.partition.sim.simulate import Event as Ev
from planner.report.events import event_label, split_tracks
from planner.report.table import compact_layers, fmt_bytes, fmt_time, layer_span, plan_summary, stage_table, summary_text
from planner.report.timeline import render_timeline, write_timeline
from planner.report.trace import DEVICES_PID, LINKS_PID, chrome_trace


EVENTS = (
    Ev("gpu0", "fwd", 0, 0, 0.0, 1e-3),
    Ev("gpu0->gpu1", "send_fwd", 0, 0, 1e-3, 1.5e-3),
    Ev("gpu1", "fwd", 1, 0, 1.5e-3, 2.5e-3),
    Ev("gpu1", "bwd", 1, 0, 2.5e-3, 4.5e-3),
    Ev("gpu1->gpu0", "send_bwd", 1, 0, 4.5e-3, 5e-3),
    Ev("gpu0", "bwd", 0, 0, 5e-3, 7e-3),
)


def _plan_doc(**stage_extra: object) -> dict:
    return {
        "schema_version": 1, "method": "dp", "schedule": "1f1b", "microbatches": 1,
        "stages": [
            {"index": 0, "device": "gpu0", "nodes": ["x", "a", "b"], "compute_s": 3e-3, "transfer_s": 5e-4,
             "memory_bytes": 900, "capacity_bytes": 1000, "idle_s": 4e-3, "layers": ["h.0", "h.1"], **stage_extra},
            {"index": 1, "device": "gpu1", "nodes": ["c"], "compute_s": 3e-3, "transfer_s": 5e-4,
             "memory_bytes": 2000, "capacity_bytes": 1000, "idle_s": 4e-3, "layers": ["lm_head"]},
        ],
        "predicted": {"step_time_s": 7e-3, "bubble_fraction": 4 / 7,
                      "devices": {"gpu0": {"busy_s": 3e-3, "idle_s": 4e-3, "peak_memory_bytes": 900},
                                  "gpu1": {"busy_s": 3e-3, "idle_s": 4e-3, "peak_memory_bytes": 2000}}},
        "cluster": {"schema_version": 1, "name": "two", "devices": [
            {"id": "gpu0", "type": "a100-80g", "host": "h0", "memory_bytes": 1000},
            {"id": "gpu1", "type": "v100-32g", "host": "h0", "memory_bytes": 1000}],
            "links": {"intra_host": {"bandwidth_Bps": 1e9, "latency_s": 0.0},
                      "inter_host": {"bandwidth_Bps": 1e9, "latency_s": 0.0}}},
    }


def _render(renderable: object) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_table_shows_device_type_layers_memory_and_idle() -> None:
    text = _render(stage_table(plan_from_dict(_plan_doc())))
    assert "gpu0 (a100-80g)" in text and "gpu1 (v100-32g)" in text
    assert "h.0-1 (2 layers, 3 ops)" in text
    assert "lm_head (1 ops)" in text
    assert "900 B / 1000 B (90%)" in text and "(200%)" in text
    assert "3 ms" in text and "500 µs" in text and "4 ms" in text


def test_summary_line_and_json_summary() -> None:
    plan = plan_from_dict(_plan_doc())
    text = _render(summary_text(plan))
    assert "placer dp · 1f1b · 1 micro-batches · 2 stages · step 7 ms · bubble 57.1%" in text
    summary = plan_summary(plan)
    assert summary["peak_memory_bytes"] == 2000
    refined = plan_from_dict({**_plan_doc(), "refine": {"rounds": [{}, {}], "stop": "balanced"}})
    assert "refined: 2 round(s), stop balanced" in _render(summary_text(refined))
    assert [s["type"] for s in summary["stages"]] == ["a100-80g", "v100-32g"]
    assert summary["stages"][0]["layers"] == ["h.0", "h.1"]
    json.dumps(summary)


@pytest.mark.parametrize(("layers", "text"), [
    (["blocks.0", "blocks.1", "ln_f", "wte"], "blocks.0-1, ln_f, wte"),
    (["h.10", "h.2", "h.3", "h.4", "h.7"], "h.2-4,7,10"),
    (["a", "b", "c", "d", "e", "f"], "a, b, c, d (+2)"),
    (["enc.0", "dec.1", "dec.0"], "dec.0-1, enc.0"),
])
def test_compact_layers(layers: list[str], text: str) -> None:
    assert compact_layers(layers) == text


def test_layer_span_without_layers_names_first_and_last_node() -> None:
    plan = plan_from_dict(_plan_doc(layers=[]))
    assert layer_span(plan.stages[0]) == "x .. b (3 ops)"


@pytest.mark.parametrize(("seconds", "text"), [(2.5, "2.5 s"), (0.0123, "12.3 ms"), (4.56e-5, "45.6 µs"),
                                               (3e-9, "3 ns"), (4.34e-19, "0 s"), (0, "0 s"), (None, "-")])
def test_fmt_time(seconds: object, text: str) -> None:
    assert fmt_time(seconds) == text


@pytest.mark.parametrize(("nbytes", "text"), [(512, "512 B"), (1536, "1.5 KiB"), (3 * 2**30, "3 GiB"), (None, "-")])
def test_fmt_bytes(nbytes: object, text: str) -> None:
    assert fmt_bytes(nbytes) == text


def test_tracks_devices_in_pipeline_order_then_links() -> None:
    devices, links = split_tracks(EVENTS, ["gpu0", "gpu1", "gpu2"])
    assert devices == ["gpu0", "gpu1", "gpu2"]  # an idle device still gets its row
    assert links == ["gpu0->gpu1", "gpu1->gpu0"]
    assert event_label(EVENTS[0]) == "F0 [s0]" and event_label(EVENTS[4]) == "sB0 [s1]"


def test_trace_has_one_track_per_device_and_complete_events() -> None:
    devices, links = split_tracks(EVENTS, ["gpu0", "gpu1"])
    trace = chrome_trace(EVENTS, devices, links, {"gpu0": "gpu0 (a100-80g)"})
    json.loads(json.dumps(trace))
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(n for (pid, _), n in names.items() if pid == DEVICES_PID) == ["gpu0 (a100-80g)", "gpu1"]
    assert sorted(n for (pid, _), n in names.items() if pid == LINKS_PID) == ["gpu0->gpu1", "gpu1->gpu0"]
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(EVENTS)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    bwd = next(e for e in complete if e["cat"] == "bwd" and e["args"]["stage"] == 0)
    assert (bwd["ts"], bwd["dur"]) == (5000.0, 2000.0)
    assert names[(bwd["pid"], bwd["tid"])] == "gpu0 (a100-80g)"


def test_trace_refuses_an_event_on_an_unknown_track() -> None:
    with pytest.raises(ValueError, match="unknown track"):
        chrome_trace(EVENTS, ["gpu0"], [], {})


def test_timeline_png_and_svg_are_real_images(tmp_path: Path) -> None:
    paths = {"png": tmp_path / "t.png", "svg": tmp_path / "t.svg"}
    written = write_timeline(EVENTS, ["gpu0", "gpu1"], ["gpu0->gpu1", "gpu1->gpu0"], {}, "toy", paths)
    assert written == paths
    assert paths["png"].read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    svg = paths["svg"].read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "gpu1" in svg


def test_timeline_checks_every_path_before_drawing(tmp_path: Path) -> None:
    paths = {"png": tmp_path / "ok.png", "svg": tmp_path / "missing" / "t.svg"}
    with pytest.raises(PlannerError, match="does not exist"):
        write_timeline(EVENTS, ["gpu0", "gpu1"], [], {}, "toy", paths)
    assert not paths["png"].exists()


def test_timeline_of_an_empty_step_still_draws() -> None:
    images = render_timeline((), ["gpu0"], [], {}, "empty", ("png",))
    assert images["png"].startswith(b"\x89PNG")


def test_memory_timeline_allocates_at_forward_and_frees_after_backward() -> None:
    from planner.report.events import memory_timeline

    samples = memory_timeline(EVENTS, {"gpu0": 100, "gpu1": 10}, {0: 5, 1: 7})
    assert samples["gpu0"] == [(0.0, 105), (7e-3, 100)]
    assert samples["gpu1"] == [(0.0, 10), (1.5e-3, 17), (4.5e-3, 10)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_memory_timeline_peak_is_the_simulators_peak(schedule: str) -> None:
    from _plan_cases import make_plan, toy_cluster, toy_profile

    from planner.app.show import _memory
    from planner.report.replay import simulate_plan

    plan = make_plan(toy_profile(), toy_cluster(), (3, 5), schedule=schedule, microbatches=6)
    sim = simulate_plan(plan)
    memory = _memory(plan, sim.events)
    for device, stats in sim.devices.items():
        assert max(level for _, level in memory[device]) == stats.peak_memory_bytes
        static = sum(s.extra["static_bytes"] for s in plan.stages if s.device == device)
        assert memory[device][-1][1] == static  # every activation freed by the end


def test_trace_carries_one_memory_counter_per_device() -> None:
    trace = chrome_trace(EVENTS, ["gpu0", "gpu1"], ["gpu0->gpu1", "gpu1->gpu0"], {},
                         memory={"gpu0": [(0.0, 105), (7e-3, 100)], "gpu1": [(0.0, 10)]})
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"memory gpu0", "memory gpu1"}
    assert [(e["ts"], e["args"]["bytes"]) for e in counters if e["name"] == "memory gpu0"] == [(0.0, 105), (7000.0, 100)]


@pytest.mark.parametrize("cluster, schedule, method", [("cpu-2", "1f1b", "dp"), ("cpu-2", "gpipe", "uniform"),
                                                       ("a100-4", "interleaved-1f1b", "greedy"),
                                                       ("mixed-3type-2host", "1f1b", "greedy"), ("t4-4-pcie", "gpipe", "dp"),
                                                       ("dgx-h100-8", "1f1b", "dp-hybrid")])
def test_every_device_row_adds_up_to_the_step(cluster: str, schedule: str, method: str) -> None:
    """Issue 12: compute, transfer (host copies), runtime overhead, optimizer step and idle per device sum to
    the step time (a 4-stage CPU plan showed 4 x 460 us compute + 1.3 ms idle against a 4.9 ms step)."""
    from pathlib import Path

    from planner.clusters import resolve_cluster
    from planner.formats.catalog import load_catalog
    from planner.formats.cluster import load_cluster
    from planner.formats.profile import load_profile
    from planner.partition import partition
    from planner.report.table import DEVICE_PARTS, device_table

    profile = load_profile(Path(__file__).resolve().parent / "golden" / "profiles" / "gpt_tiny.json")
    hybrid = method.endswith("-hybrid")
    plan = partition(profile, load_cluster(resolve_cluster(cluster)), method=method.removesuffix("-hybrid"),
                     microbatches=8, schedule=schedule, catalog=load_catalog(), data_parallel=2 if hybrid else 1)
    devices = plan.predicted["devices"]
    assert devices and device_table(plan) is not None
    assert hybrid == all(parts.get("sync_s", 0.0) > 0 for parts in devices.values())  # sync: replicas only
    for device, parts in devices.items():
        total = sum(parts.get(key, 0.0) for _, key in DEVICE_PARTS)
        assert total == pytest.approx(plan.step_time_s, rel=1e-9), (device, parts)
        assert parts["compute_s"] > 0
    if cluster == "cpu-2":
        assert any(p["overhead_s"] > 0 and p["copy_s"] > 0 for p in devices.values())


def test_a_run_summary_says_replicas_and_which_way_the_prediction_missed() -> None:
    """Issue 23, item 8: a hybrid run's summary never said replicas, and '+9%' did not say slower or faster."""
    from rich.console import Console

    from planner.report.render import render_run

    console = Console(record=True, width=200)
    render_run(console, {"steps": 4, "losses": [2.0, 1.9, 1.8, 1.7], "world_size": 4, "backend": "gloo",
                         "schedule": "1f1b", "microbatches": 8, "microbatch_size": 2, "optimizer": "sgd", "lr": 0.01,
                         "loss": "cross_entropy", "wall_s": 4.0, "eval": [], "target": None,
                         "sync": {"mode": "ssgd", "degree": 2, "shares": [5, 3]},
                         "step_time_s": 1.09, "predicted_step_time_s": 1.0,
                         "calibration": {"rounds": 2, "compute_factors": {"cpu0": 1.1}, "calibrated_step_time_s": 1.2}})
    text = console.export_text()
    assert "2 replicas (data parallel; micro-batches 5/3, ssgd)" in text
    assert "+9%: measured slower than predicted" in text and "-9%: measured faster than predicted" in text


def test_the_summary_names_devices_a_plan_leaves_idle() -> None:
    """Issue 23, item 5: `-d 3` on 4 devices left one idle without a word."""
    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.formats.profile import load_profile
    from planner.partition import partition

    golden = Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json"
    cluster = load_cluster_spec("a100-4")
    three = partition(load_profile(golden), cluster, method="dp", microbatches=9, schedule="1f1b",
                      granularity="layer", data_parallel=3, catalog=load_catalog())
    idle = [d for d in cluster.device_ids if d not in {x for devices in three.replicas() for x in devices}]
    assert len(idle) == 1
    assert f"not used: {idle[0]} (1 of 4 devices; 3 replica pipelines of 1 device each)" in summary_text(three).plain
    four = partition(load_profile(golden), cluster, method="dp", microbatches=8, schedule="1f1b",
                     granularity="layer", data_parallel=4, catalog=load_catalog())
    assert "not used" not in summary_text(four).plain
