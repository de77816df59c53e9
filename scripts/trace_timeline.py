"""Where a device's time goes in a `jax.profiler` trace: compute, collectives hidden behind compute, collectives
exposed (nothing else running), and idle gaps.

    python scripts/trace_timeline.py TRACE_DIR --steps 3       # one JSON line per device of the newest trace

A multi-device step is slower than one device's for three reasons the durations alone cannot tell apart: its
collectives run while no computation does (exposed), its computation itself grew (resharding copies, slower
kernels), or the device waits (for the host, for another device). This reads every op of every stream of each
device with its start and end, merges the intervals of computation and of collectives separately, and reports
per step: the span (first op's start to last op's end, divided by the steps), computation busy time, collective
busy time, the collective time no computation overlaps, and the time nothing ran. `bench_scaling.py --profile N`
runs it on N update steps of every layout, so the multi-device rows compare directly with the one-device row.

Kernels can also be named after the HLO instruction that launched them (the trace's `hlo_op` stat) and labelled
from the compiled program's op names (`hlo_labels`; `update_part` names the parts of the trainer's update step,
e.g. "MLP (backward)"): bench_scaling reports the exposed collectives by part, bench_update --profile the time.

On a CPU (fake devices) the host's XLA op events stand in for device streams: they carry no stream per device,
so the CPU breakdown is one timeline of the whole host, useful only to check that the tool runs.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from typing import Callable

# NCCL kernels and XLA's own names for collectives (GPU kernels are named after their HLO instruction, "." -> "_")
COLLECTIVE = re.compile(r"nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|collective[-_]?permute|"
                        r"all[-_]?to[-_]?all|sendrecv|send[-_]recv")
# events that are not work: the CPU runtime's wrappers around the ops they run
WRAPPER = re.compile(r"^ThunkExecutor|^ExecuteHelper|^PjRt|^Execute$|^SlinkyThreadPool")


def _hlo_op(event) -> str | None:
    for key, value in event.stats:
        if key == "hlo_op":
            return str(value)
    return None


def device_events(trace_dir: str) -> dict[str, list[tuple[str, str | None, int, int]]]:
    """{device plane name: [(kernel name, hlo_op or None, start ns, end ns), ...]} from the newest `.xplane.pb`
    under `trace_dir`, by start: every op on every stream line of each GPU; on a CPU, the host's XLA op lines as
    one 'device'. `hlo_op` is the trace's name for the HLO instruction that launched the kernel, where it gives
    one (a cuBLAS or cuDNN kernel has a library name of its own; a fusion's kernel is named after its
    instruction)."""
    from jax.profiler import ProfileData

    paths = [os.path.join(root, f) for root, _, files in os.walk(trace_dir) for f in files
             if f.endswith(".xplane.pb")]
    if not paths:
        raise RuntimeError(f"no .xplane.pb under {trace_dir}: the profiler wrote nothing")
    data = ProfileData.from_file(max(paths, key=os.path.getmtime))
    gpus, host = {}, []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            events = gpus.setdefault(plane.name, [])
            for line in plane.lines:
                # one line per stream holds the kernels; "XLA Ops" / "XLA Modules" repeat them: skip those
                if "Stream" in line.name:
                    events.extend((ev.name, _hlo_op(ev), int(ev.start_ns), int(ev.end_ns)) for ev in line.events)
        elif plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                if "XLA" in line.name or "TFRT" in line.name or "tf_XLA" in line.name:
                    host.extend((ev.name, _hlo_op(ev), int(ev.start_ns), int(ev.end_ns))
                                for ev in line.events if not WRAPPER.search(ev.name))
    gpus = {name: sorted(events, key=lambda e: e[2]) for name, events in gpus.items() if events}
    return gpus or ({"/host:CPU": sorted(host, key=lambda e: e[2])} if host else {})


def named(events, labels: dict[str, str] | None = None) -> list[tuple[str, int, int]]:
    """[(name, start, end)] of `device_events`' events: named by their kernel, or, with `labels` (keyed by
    `kernel_key`, from `hlo_labels`), by whichever of their HLO op and kernel name the labels know (the HLO op
    first), else by the HLO op where the trace gives one. Both are needed: library kernels are known by their
    HLO op only, and a trace may give one HLO op for many kernels (a command buffer replaying its kernels)."""
    if labels is None:
        return [(kernel, start, end) for kernel, _, start, end in events]
    return [(next((n for n in (op, kernel) if n and kernel_key(n) in labels), op or kernel), start, end)
            for kernel, op, start, end in events]


def device_timelines(trace_dir: str, labels: dict[str, str] | None = None) -> dict[str, list[tuple[str, int, int]]]:
    """{device plane name: [(op name, start ns, end ns), ...]}: `device_events` named by `named`."""
    return {plane: named(events, labels) for plane, events in device_events(trace_dir).items()}


def kernel_key(name: str) -> str:
    """A GPU kernel is named after its HLO instruction with "." as "_": the key both are looked up by."""
    return name.replace(".", "_")


def hlo_labels(hlo_text: str, label_of: Callable[[str], str | None]) -> dict[str, str]:
    """{kernel_key(HLO instruction): label} from a compiled program's text, where `label_of(op_name)` labels an
    instruction by the op_name of its metadata (the jitted function's path: flax module paths, named scopes,
    `transpose(jvp(...))` for the backward) or returns None; a fusion or call gets the label most of the
    instructions of the computation it calls carry."""
    label, votes, current = {}, collections.defaultdict(collections.Counter), None
    for line in hlo_text.splitlines():
        head = re.match(r"\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            current = head.group(1)
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"", line)
        if not m:
            continue
        name, op_name = m.groups()
        got = label_of(op_name)
        if got:
            label[kernel_key(name)] = got
            if current:
                votes[current][got] += 1
    for line in hlo_text.splitlines():  # fusions and calls: the label of the computation they call
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?calls=%?([\w.\-]+)", line)
        if m and kernel_key(m.group(1)) not in label and votes.get(m.group(2)):
            label[kernel_key(m.group(1))] = votes[m.group(2)].most_common(1)[0][0]
    return label


def hlo_instructions(hlo_text: str) -> dict[str, str]:
    """{kernel_key(instruction): "<shape> <opcode> <op_name>"} of every instruction in a compiled program's text
    (fused ones included; the op_name's last 120 characters): what a kernel named after its instruction computes,
    and for which part of the jitted function."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+([\w\-]+)\(", line)
        if m:
            name, shape, opcode = m.groups()
            op_name = re.search(r'op_name="([^"]*)"', line)
            out[kernel_key(name)] = f"{shape} {opcode}" + (f" {op_name.group(1)[-120:]}" if op_name else "")
    return out


# The parts of the trainer's update step, from an HLO instruction's op_name (flax module paths; in the backward
# `transpose(jvp(...))`); the first pattern that matches names it
_MODEL_PARTS = (("q/k/v projections", r"/(q_proj|k_proj|v_proj)(/|$)"), ("o_proj", r"/o_proj(/|$)"),
                ("MLP", r"/mlp(/|$)"), ("attention", r"/self_attn(/|$)"), ("norms", r"layernorm|/norm(/|$)"),
                ("embedding lookup", r"\.embed(/|$)|/embed_tokens"), ("lm_head", r"attend|lm_head|logits_from_hidden"))


def update_part(op_name: str) -> str:
    """The part of the trainer's update step an HLO instruction belongs to (a `label_of` for `hlo_labels`), e.g.
    'MLP (backward)', 'log-probs and loss', 'optimizer and metrics'."""
    if "CausalLM" in op_name or "model.attend" in op_name:
        part = next((name for name, pattern in _MODEL_PARTS if re.search(pattern, op_name)), "model, other")
        return f"{part} ({'backward' if 'transpose(' in op_name else 'forward'})"
    if "/while/" in op_name or "closed_call" in op_name or "log_softmax" in op_name:
        return "log-probs and loss"  # the micro-batch loop's own ops outside the model
    return "optimizer and metrics"


def time_by_label(events: list[tuple[str, int, int]], labels: dict[str, str], steps: int) -> dict[str, float]:
    """Summed kernel ms per step by label (`labels` from `hlo_labels`, keyed by `kernel_key`; "unlabelled" for
    the rest), largest first."""
    total = collections.Counter()
    for name, start, end in events:
        total[labels.get(kernel_key(name)) or "unlabelled"] += end - start
    return {k: round(ns / 1e6 / steps, 3) for k, ns in total.most_common()}


def _merge(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(merged) -> int:
    return sum(end - start for start, end in merged)


def _minus(a, b) -> int:
    """Length of the merged intervals `a` not covered by the merged intervals `b`."""
    out, j = 0, 0
    for start, end in a:
        cursor = start
        while j < len(b) and b[j][1] <= cursor:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out += b[k][0] - cursor
            cursor = max(cursor, b[k][1])
            k += 1
        out += max(0, end - cursor)
    return out


def breakdown(events: list[tuple[str, int, int]], steps: int, top: int = 8, labels: dict[str, str] | None = None
              ) -> dict:
    """Per-step milliseconds of one device's timeline (see the module's docstring), and the collectives with the
    most exposed time; with `labels` (`hlo_labels` of the program, events named by HLO op) also the exposed time
    by label, e.g. the part of the model whose collective it was."""
    if not events:
        raise ValueError("no device events in the trace")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    comm = [(s, e) for name, s, e in events if COLLECTIVE.search(name.lower())]
    work = [(s, e) for name, s, e in events if not COLLECTIVE.search(name.lower())]
    comm_m, work_m = _merge(comm), _merge(work)
    span = max(e for _, _, e in events) - min(s for _, s, _ in events)
    busy = _length(_merge(comm + work))
    exposed_by_op = {}
    for name, s, e in events:
        if COLLECTIVE.search(name.lower()):
            exposed_by_op[name] = exposed_by_op.get(name, 0) + _minus([[s, e]], work_m)

    def ms(ns):
        return round(ns / 1e6 / steps, 3)

    out = {"span_ms": ms(span), "compute_ms": ms(_length(work_m)), "collective_ms": ms(_length(comm_m)),
           "exposed_collective_ms": ms(_minus(comm_m, work_m)), "idle_ms": ms(span - busy),
           "collective_launches": round(len(comm) / steps, 1),
           "top_exposed": [{"op": name[:100], "ms": ms(ns), **({"label": labels.get(kernel_key(name))}
                                                                 if labels is not None else {})}
                           for name, ns in sorted(exposed_by_op.items(), key=lambda kv: -kv[1])[:top] if ns > 0]}
    if labels is not None:
        by_label = collections.Counter()
        for name, ns in exposed_by_op.items():
            by_label[labels.get(kernel_key(name)) or "unlabelled"] += ns
        out["exposed_by_label"] = {k: ms(ns) for k, ns in by_label.most_common() if ms(ns) > 0}
    return out


def summarise_trace(trace_dir: str, steps: int, top: int = 8, labels: dict[str, str] | None = None) -> dict:
    """{device: breakdown} for every device of the trace, plus the mean over devices of each number. With
    `labels` (see `breakdown`) events are named as `named` says."""
    timelines = device_timelines(trace_dir, labels)
    per_device = {name: breakdown(events, steps, top, labels) for name, events in timelines.items()}
    if not per_device:
        raise RuntimeError(f"the trace under {trace_dir} holds no device events")
    keys = ("span_ms", "compute_ms", "collective_ms", "exposed_collective_ms", "idle_ms")
    mean = {k: round(sum(d[k] for d in per_device.values()) / len(per_device), 3) for k in keys}
    return {"mean": mean, "devices": per_device}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--steps", type=int, default=1, help="steps the trace holds (figures are per step)")
    p.add_argument("--top", type=int, default=8, help="collectives listed by exposed time")
    args = p.parse_args(argv)
    for name, row in summarise_trace(args.trace_dir, args.steps, args.top)["devices"].items():
        print(json.dumps({"device": name, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
