"""scripts/plot_runs.py: PNG curves per metric group for several runs, missing metrics reported and skipped,
the TensorBoard fallback, and the before -> after eval table equal to the logged numbers.

The runs here are a fixture: synthetic scalars written with the trainer's own MetricWriter (the same
`tensorboard/` event files and metrics.jsonl a training run writes, and a summary.json like the trainer's), no
model or rollout behind them."""

import json
import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from agentfly_jax.trainer.metrics import MetricWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import plot_runs

STEPS = 12


def _write_run(directory: Path, seed: int, *, drop=(), algorithm="grpo") -> dict:
    """A run's scalars (eval at 0, 6 and the last step; training metrics every step); returns what was logged."""
    rng = np.random.default_rng(seed)
    writer = MetricWriter(str(directory / "tensorboard"))
    logged = {}

    def log(step, values):
        values = {k: v for k, v in values.items() if k not in drop}
        writer.scalars(step, values)
        for tag, value in values.items():
            logged.setdefault(tag, []).append((step, float(value)))

    for step in range(STEPS + 1):
        if step in (0, STEPS // 2, STEPS):
            success = round(0.2 + 0.5 * step / STEPS + 0.01 * seed, 4)
            log(step, {"eval/success": success, "eval/reward": success + 0.05,
                       "eval/success_sampled": success - 0.03, "eval/tool_calls": 1.0 + step / STEPS})
        if step == 0:
            continue
        reward = 0.1 + 0.6 * step / STEPS + 0.05 * rng.standard_normal()
        log(step, {
            "reward/mean": reward, "success/rate": min(1.0, max(0.0, reward)),
            "policy/approx_kl": 0.01 * step * (1 + seed), "policy/entropy": 1.5 - 0.05 * step - 0.2 * seed,
            "rollout/response_tokens_mean": 40.0 + (3 + seed) * step,
            "rollout/tool_calls_mean": 0.5 + (0.1 + 0.05 * seed) * step,
            "rollout/tool_errors": float(max(0, 6 - step)), "rollout/chains": 16.0 + 8 * seed,
            # a non-finite value is data too: the writer keeps it as text in the JSONL
            "policy/grad_norm": math.nan if step == 3 else 1.0,
        })
    writer.close()
    (directory / "summary.json").write_text(json.dumps({
        "algorithm": algorithm, "environment": "arithmetic", "steps": STEPS,
        "success_before": logged["eval/success"][0][1], "success_after": logged["eval/success"][-1][1]}))
    return logged


@pytest.fixture()
def runs(tmp_path):
    """Two synthetic runs; the second logged no policy entropy and no tool errors."""
    first = _write_run(tmp_path / "run_grpo", 0)
    second = _write_run(tmp_path / "run_ppo", 1, drop=("policy/entropy", "rollout/tool_errors"), algorithm="ppo")
    return tmp_path, {"run_grpo": first, "run_ppo": second}


def _image(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        image.verify()
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def _has_colour(pixels: np.ndarray, hex_colour: str, tolerance: int = 12) -> int:
    rgb = np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(pixels.astype(int) - rgb).max(axis=-1) <= tolerance).sum())


def test_every_group_is_plotted_for_both_runs(runs):
    root, _ = runs
    messages = []
    written = plot_runs.plot_runs([root / "run_grpo", root / "run_ppo"], root / "plots", smooth_window=3,
                                  report=messages.append)
    assert set(written) == set(plot_runs.GROUPS)
    for key, path in written.items():
        assert path == root / "plots" / f"{key}.png"
        pixels = _image(path)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 500
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50  # text, axes and curves, not a blank canvas
        assert _has_colour(pixels, "#1f77b4") > 100, key  # the first run's colour (matplotlib's C0)
    # the second run's curves are there where it logged the metric, missing where it did not
    assert _has_colour(_image(written["reward"]), "#ff7f0e") > 100
    assert _has_colour(_image(written["entropy"]), "#ff7f0e") == 0
    # every absent metric is reported by name: the reference KL (neither run) and the second run's two gaps
    assert "run_ppo: no policy/entropy (entropy); skipped" in messages
    assert "run_ppo: no rollout/tool_errors / rollout/chains (tool_errors); skipped" in messages
    assert "run_grpo: no policy/kl_ref (kl); skipped" in messages
    assert not any(m.startswith("run_grpo") and "entropy" in m for m in messages)


def test_missing_groups_and_raw_tags(runs, capsys):
    root, _ = runs
    messages = []
    written = plot_runs.plot_runs([root / "run_ppo"], root / "plots", ["entropy", "time/update_s",
                                                                        "policy/grad_norm"], report=messages.append)
    assert set(written) == {"policy/grad_norm"} and written["policy/grad_norm"].name == "policy_grad_norm.png"
    assert "entropy: no run logged it; no plot written" in messages
    assert "run_ppo: no time/update_s (time/update_s); skipped" in messages
    # the CLI reports the same on stderr and exits 0
    assert plot_runs.main([str(root / "run_ppo"), "--out", str(root / "cli"), "--metrics", "entropy,reward"]) == 0
    captured = capsys.readouterr()
    assert "no policy/entropy" in captured.err and "reward: " in captured.out
    assert (root / "cli" / "reward.png").is_file() and not (root / "cli" / "entropy.png").exists()


def test_table_numbers_are_the_logged_numbers(runs, capsys):
    root, logged = runs
    assert plot_runs.main([str(root / "run_grpo"), str(root / "run_ppo"), "--table"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| run_")]
    assert len(lines) == 2
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name, algorithm, environment, steps, success, reward = cells
        assert algorithm == ("grpo" if name == "run_grpo" else "ppo") and environment == "arithmetic"
        assert steps == str(STEPS)
        for cell, tag in ((success, "eval/success"), (reward, "eval/reward")):
            before, after, delta = (float(x) for x in re.fullmatch(r"(\S+) → (\S+) \((\S+)\)", cell).groups())
            series = logged[name][tag]
            assert (before, after) == (round(series[0][1], 3), round(series[-1][1], 3))
            assert series[0][0] == 0 and series[-1][0] == STEPS
            assert delta == pytest.approx(series[-1][1] - series[0][1], abs=1.5e-3)
        summary = json.loads((root / name / "summary.json").read_text())
        assert float(success.split(" → ")[1].split()[0]) == round(summary["success_after"], 3)


def test_a_run_cut_before_its_summary_is_named_from_its_config(runs, capsys):
    """A run stopped mid-way (no summary.json) still gets its algorithm and environment from the config.json the
    trainer wrote at its start, and its steps cell says how far its last eval got of the planned steps."""
    root, logged = runs
    (root / "run_ppo" / "summary.json").unlink()
    (root / "run_ppo" / "config.json").write_text(json.dumps(
        {"algorithm": "ppo", "env": {"name": "webshop"}, "rl": {"steps": 40}}))
    (root / "run_grpo" / "summary.json").unlink()  # neither summary nor config: dashes, last eval step
    assert plot_runs.main([str(root / "run_ppo"), str(root / "run_grpo"), "--table"]) == 0
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| run_")}
    assert rows["run_ppo"][1:4] == ["ppo", "webshop", f"{STEPS} of 40, cut"]
    assert rows["run_grpo"][1:4] == ["—", "—", str(STEPS)]
    after = logged["run_ppo"]["eval/success"][-1][1]
    assert rows["run_ppo"][4].split(" → ")[1].startswith(f"{after:.3f}")


def test_jsonl_and_event_files_agree_and_resumed_steps_keep_their_last_value(runs):
    root, logged = runs
    from_jsonl = plot_runs.load_run(root / "run_grpo")
    assert from_jsonl.source == "jsonl" and from_jsonl.name == "run_grpo"
    assert from_jsonl.scalars["reward/mean"] == logged["run_grpo"]["reward/mean"]
    assert math.isnan(dict(from_jsonl.scalars["policy/grad_norm"])[3])
    # without the JSONL the event files are read (float32 there); the NaN step is a gap in TensorBoard
    (root / "run_grpo" / "tensorboard" / "metrics.jsonl").unlink()
    from_events = plot_runs.load_run(root / "run_grpo" / "tensorboard")
    assert from_events.source == "tensorboard"
    for tag in ("reward/mean", "eval/success", "rollout/tool_errors"):
        assert [s for s, _ in from_events.scalars[tag]] == [s for s, _ in logged["run_grpo"][tag]]
        assert [v for _, v in from_events.scalars[tag]] == pytest.approx([v for _, v in logged["run_grpo"][tag]],
                                                                         rel=1e-6)
    # a resumed run appends the steps it redoes: the last value of a step wins
    resumed = root / "resumed" / "tensorboard"
    resumed.mkdir(parents=True)
    (resumed / "metrics.jsonl").write_text(
        '{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean": 0.2}\n{"step": 2, "reward/mean": 0.25}\n'
        '{"step": 3, "reward/mean": 0.3, "eval/success": "nan"}\n{"step": 4, "rew'  # killed mid-write
    )
    scalars = plot_runs.load_run(root / "resumed").scalars
    assert scalars["reward/mean"] == [(1, 0.1), (2, 0.25), (3, 0.3)] and math.isnan(scalars["eval/success"][0][1])
    with pytest.raises(FileNotFoundError, match="not a directory"):
        plot_runs.load_run(root / "nothing_here")
    (root / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl and no TensorBoard scalars"):
        plot_runs.load_run(root / "empty")
    shutil.rmtree(root / "resumed")


def test_smoothing_is_a_trailing_mean_that_skips_nans():
    assert plot_runs.smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert plot_runs.smooth([1.0, math.nan, 3.0], 3) == [1.0, 1.0, 2.0]
    assert plot_runs.smooth([5.0], 1) == [5.0]
