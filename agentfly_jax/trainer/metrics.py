"""Metrics out of the training loop: TensorBoard event files (no TensorFlow needed) plus a JSONL copy."""
from __future__ import annotations

import json
import math
import os
import time
from typing import Mapping

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.plugins.text.summary_v2 import text_pb
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class MetricWriter:
    """Writes scalars and text to `<logdir>` (TensorBoard) and appends scalars to `<logdir>/metrics.jsonl`.

    `active=False` (the processes other than 0 of a multi-process run: process 0 writes the run's metrics, already
    reduced over every process) writes nothing and creates no file or directory."""

    def __init__(self, logdir: str, active: bool = True):
        self.logdir, self.active = logdir, bool(active)
        if not self.active:
            return
        os.makedirs(logdir, exist_ok=True)
        self._events = EventFileWriter(logdir)
        self._jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if not self.active:
            return
        clean = {}
        for tag, value in values.items():
            value = float(value)
            if not math.isfinite(value):
                # a NaN/inf is data too: keep it in the JSONL, TensorBoard shows it as a gap
                clean[tag] = str(value)
                continue
            clean[tag] = value
        summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in clean.items()
                                 if isinstance(v, float)])
        self._events.add_event(Event(wall_time=time.time(), step=int(step), summary=summary))
        self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")

    def text(self, step: int, tag: str, text: str) -> None:
        if not self.active:
            return
        self._events.add_event(Event(wall_time=time.time(), step=int(step), summary=text_pb(tag, text)))

    def flush(self) -> None:
        if not self.active:
            return
        self._events.flush()
        self._jsonl.flush()

    def close(self) -> None:
        if not self.active:
            return
        self._events.close()
        self._jsonl.close()


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Reads back every scalar tag of the event files in `logdir`: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
