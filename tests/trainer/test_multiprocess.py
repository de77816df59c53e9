"""Training with several processes (jax.distributed; docs/tpu.md "Training with several processes"), on this CPU:
processes of 4 devices each joined by gloo collectives, against one process of 8 devices.

The host-side pieces are tested in this process (the shares of the tasks, the blocks of packed rows that make the
global batch, the combination of the processes' scalars, a writer that writes nothing); the rest runs the trainer
in real child processes: the quickstart's SFT stage, and checkpoints written by one process count and restored
by another (a whole RL run on 2 processes is checked in test_process_faults.py, as the uninterrupted run its
resume is compared with). Every child run has a deadline and is killed with its siblings when one fails or hangs."""
import json
import os
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from agentfly_jax.trainer import distributed
from agentfly_jax.trainer.batch import pack_step, place_block, rows_needed, unpack_index_from, unpack_rows
from agentfly_jax.trainer.loop import combine_process_metrics
from agentfly_jax.trainer.metrics import MetricWriter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "OMPI_MCA_orte_hnp_uri",
                "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "CLOUD_TPU_TASK_ID")


# ================================================================================================ host side
def test_process_shares_are_disjoint_contiguous_and_cover_everything():
    for count in (1, 4, 7, 16, 33):
        for processes in (1, 2, 3, 4):
            shares = [list(range(count))[distributed.process_share(count, p, processes)] for p in range(processes)]
            assert sum(shares, []) == list(range(count))  # in order, every item once
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert distributed.process_share(5) == slice(0, 5)  # one process (this one): everything
    assert distributed.allgather_json({"a": [1.5]}) == [{"a": [1.5]}]


def _trajectories(rng, n, t):
    lengths = rng.integers(3, t + 1, n).astype(np.int32)
    tokens = np.zeros((n, t), np.int32)
    mask = np.zeros((n, t), np.float32)
    for i, n_i in enumerate(lengths):
        tokens[i, :n_i] = rng.integers(1, 50, n_i)
        mask[i, 2:n_i] = 1
    return tokens, mask, lengths


@pytest.mark.parametrize("counts,micro_batches", [((5, 3), 1), ((4, 0), 2), ((2, 7), 2)])
def test_process_blocks_assemble_a_global_batch(counts, micro_batches):
    """Each "process" packs its own trajectories (a process with none pads with empty rows); the blocks placed side
    by side in every micro-batch, with the global pack_index, unpack to every trajectory of every process, in process
    order: the unpack_index derived from the global pack_index (numpy and on the device) finds each token."""
    rng = np.random.default_rng(1)
    t, mini_batches, multiple = 16, 2, 2
    parts = [_trajectories(rng, n, t) for n in counts]
    total = sum(counts)
    minibatch = np.random.default_rng(2).permutation(total) % mini_batches
    firsts = np.cumsum((0,) + counts)[:-1]
    need = max(rows_needed(p[2], minibatch[f:f + n], mini_batches, 24) for p, f, n in zip(parts, firsts, counts))
    blocks = []
    for (tokens, mask, lengths), first, n in zip(parts, firsts, counts):
        block = pack_step(tokens, mask, np.zeros_like(mask), lengths, rewards=np.zeros(n), group_ids=np.arange(n),
                          minibatch=minibatch[first:first + n], num_minibatches=mini_batches,
                          micro_batches=micro_batches, rows_multiple=multiple, row_len=24, min_rows=need,
                          row_blocks=len(counts))
        blocks.append(place_block(block, first_trajectory=int(first), num_trajectories=total))
    assert len({b.rows.tokens.shape for b in blocks}) == 1  # the processes agree on K, M, R and L
    k, m, r, length = blocks[0].rows.tokens.shape
    assert (k, m, length) == (mini_batches, micro_batches, 24) and r % multiple == 0

    def glue(name):  # [K, M, R, L] blocks side by side in every micro-batch, as the devices hold them
        return np.concatenate([getattr(b.rows, name) if name != "pack_index" else b.pack_index for b in blocks],
                              axis=2)

    pack_index = glue("pack_index")
    unpack_index = unpack_index_from(pack_index, total, t)
    np.testing.assert_array_equal(np.asarray(unpack_index_from(jnp.asarray(pack_index), total, t)), unpack_index)
    every_tokens = np.concatenate([p[0] for p in parts])
    every_mask = np.concatenate([p[1] for p in parts])
    every_lengths = np.concatenate([p[2] for p in parts])

    class View:  # what unpack_rows reads of a batch
        pass

    view = View()
    view.unpack_index = unpack_index
    np.testing.assert_array_equal(unpack_rows(glue("tokens"), view), every_tokens)
    np.testing.assert_array_equal(unpack_rows(glue("action_mask"), view), every_mask)
    assert ((unpack_index >= 0).sum(axis=1) == every_lengths).all()
    # each trajectory sits in its own mini-batch's rows
    for i in range(total):
        assert (unpack_index[i, :every_lengths[i]] // (m * r * len(counts) * length) == minibatch[i]).all()
    # padding slots point past the [N, T] view
    assert ((pack_index == total * t) == (glue("segment_ids") == 0)).all()


def test_one_process_packing_is_unchanged_by_the_new_arguments():
    rng = np.random.default_rng(3)
    tokens, mask, lengths = _trajectories(rng, 9, 20)
    kw = dict(rewards=np.zeros(9), group_ids=np.arange(9), minibatch=np.arange(9) % 2, num_minibatches=2,
              micro_batches=2, rows_multiple=2, row_len=32)
    a = pack_step(tokens, mask, np.zeros_like(mask), lengths, **kw)
    b = pack_step(tokens, mask, np.zeros_like(mask), lengths, min_rows=0, row_blocks=1, **kw)
    for x, y in zip(jax_leaves(a), jax_leaves(b)):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(unpack_index_from(np.asarray(a.pack_index), 9, 20), a.unpack_index)
    same = place_block(a, first_trajectory=0, num_trajectories=9)
    np.testing.assert_array_equal(same.pack_index, a.pack_index)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_process_metrics_combine_into_the_runs():
    a = {"rollout/chains": 6.0, "rollout/tool_calls": 4.0, "rollout/tool_latency_s_mean": 1.0,
         "rollout/turns_per_chain": 2.0, "rollout/envs_in_use_peak": 5.0, "rollout/wall_time_s": 3.0,
         "dynamic_sampling/rounds": 1.0, "sampler/compiles": 4.0, "rollout/chain_errors_dropped": 1.0}
    b = {"rollout/chains": 2.0, "rollout/tool_calls": 0.0, "rollout/tool_latency_s_mean": 0.0,
         "rollout/turns_per_chain": 1.0, "rollout/envs_in_use_peak": 7.0, "rollout/wall_time_s": 2.0,
         "dynamic_sampling/rounds": 3.0, "sampler/compiles": 3.0, "rollout/chain_errors_dropped": 0.0}
    assert combine_process_metrics([a, b]) == {
        "rollout/chains": 8.0, "rollout/tool_calls": 4.0,
        "rollout/tool_latency_s_mean": 1.0,  # per tool call: process 1 made none
        "rollout/turns_per_chain": (6 * 2 + 2 * 1) / 8, "rollout/envs_in_use_peak": 7.0, "rollout/wall_time_s": 3.0,
        "dynamic_sampling/rounds": 3.0, "sampler/compiles": 4.0, "rollout/chain_errors_dropped": 1.0}
    assert combine_process_metrics([a]) == a
    # the sampler's prompt counters add up; the share reused is per prompt token
    c = {"sampler/prompt_tokens": 300.0, "sampler/prefix_tokens_reused": 270.0, "sampler/prefix_reused_fraction": 0.9}
    d = {"sampler/prompt_tokens": 100.0, "sampler/prefix_tokens_reused": 10.0, "sampler/prefix_reused_fraction": 0.1}
    assert combine_process_metrics([c, d]) == {"sampler/prompt_tokens": 400.0, "sampler/prefix_tokens_reused": 280.0,
                                               "sampler/prefix_reused_fraction": 280 / 400}


def test_an_inactive_writer_creates_nothing(tmp_path):
    writer = MetricWriter(str(tmp_path / "tensorboard"), active=False)
    writer.scalars(1, {"a": 1.0})
    writer.text(1, "t", "x")
    writer.flush()
    writer.close()
    assert not (tmp_path / "tensorboard").exists()


# ============================================================================ real processes on this CPU
_CHILD = r'''
import hashlib, json, os, sys
import numpy as np
port, pid, nproc, workdir, mode, overrides = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                              sys.argv[5], json.loads(sys.argv[6]))
written = []  # files and folders process > 0 creates or writes under the workdir (an audit hook sees Python's)
if pid:
    root = os.path.realpath(workdir)
    def audit(event, args):
        if event == "open" and isinstance(args[0], str) and args[1] and any(c in args[1] for c in "wax+"):
            path = os.path.realpath(args[0])
        elif event in ("os.mkdir", "os.rename", "os.replace") and isinstance(args[0], str):
            path = os.path.realpath(args[0])
        else:
            return
        if path.startswith(root + os.sep):  # (the workdir itself is the run's, made by every process)
            written.append(os.path.relpath(path, root))
    sys.addaudithook(audit)
from experiments import quickstart
c = quickstart.get_config("cpu")
c.workdir, c.progress = workdir, False
if nproc > 1 or overrides.pop("one_process_cluster", False):
    c.distributed.coordinator_address = f"127.0.0.1:{port}"
    c.distributed.num_processes, c.distributed.process_id, c.distributed.initialization_timeout = nproc, pid, 60
for key, value in overrides.items():
    section, _, name = key.rpartition(".")
    (c[section] if section else c)[name] = tuple(map(tuple, value)) if isinstance(value, list) else value
import jax
from agentfly_jax.trainer import loop

def host_tree(tree):
    flat = jax.tree_util.tree_leaves_with_path(loop._host_params(tree))
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}

def save(name, tree):
    if pid == 0:
        np.savez(os.path.join(workdir, name), **tree)

out = {}
if mode == "train":
    out["summary"] = {k: v for k, v in loop.train(c).items() if k != "wall_seconds"}
else:
    run = loop.setup(c)
    try:
        if mode == "sft":
            out["sft"] = loop.run_sft(run)
            save("params.npz", host_tree(run.state.policy.params))
        elif mode == "save":  # a state worth saving: a few SFT steps, then the checkpoint of step 3
            loop.run_sft(run)
            loop._save(run, 3, {"eval/success": 0.5}, force=True)
            save("saved.npz", host_tree(run.state))
        elif mode == "restore":  # the newest checkpoint as train(resume=True) loads it, then saved again
            step, tree, meta = run.checkpointer.restore_latest(loop._checkpoint_tree(run))
            run.state = jax.device_put(tree["state"], run.shardings)
            out["restored"] = [step, meta["eval_before"]]
            save("restored.npz", host_tree(run.state))
            loop.run_sft(run)
            loop._save(run, 7, {}, force=True)
            save("saved.npz", host_tree(run.state))
    finally:
        loop._close_run(run)
out["written"] = sorted(set(written))
print(json.dumps(out))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_processes(processes: int, devices: int, workdir, mode: str, overrides: dict) -> list[subprocess.Popen]:
    """Starts the child in `processes` processes of `devices` CPU devices each (stdout and stderr piped)."""
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    port = _free_port()
    return [subprocess.Popen([sys.executable, "-c", _CHILD, str(port), str(pid), str(processes), str(workdir), mode,
                              json.dumps(overrides)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for pid in range(processes)]


def _processes(processes: int, devices: int, workdir, mode: str, overrides: dict, timeout: float = 600):
    """Runs the child in `processes` processes of `devices` CPU devices each; [(returncode, its JSON, stderr)].
    All are killed at `timeout` s, and the others as soon as one fails (a process left alone would wait for its
    peers at the next collective)."""
    procs = _start_processes(processes, devices, workdir, mode, overrides)
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p in procs:
        out, err = p.communicate()
        lines = out.strip().splitlines()
        results.append((p.returncode, json.loads(lines[-1]) if p.returncode == 0 and lines else None, err))
    for pid, (rc, _, err) in enumerate(results):
        assert rc == 0, f"process {pid} of {processes} ended with {rc}:\n{err[-4000:]}"
    return [got for _, got, _ in results]


def _load(path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_sft_on_two_processes_ends_with_the_parameters_of_one(tmp_path):
    """The quickstart's SFT stage (two short stages) on 2 processes x 4 devices and on 1 process x 8 devices: every
    process builds each step's whole batch and hands its devices their rows, so the global batches are the same,
    and the step-1 scalars and the parameters after the stage agree (fp32). The one process runs as a jax.distributed
    cluster of one (config.distributed.num_processes=1 with a coordinator_address), so that its all-reduces are
    gloo's, as the two processes' are: the same sums in the same order."""
    stages = {"sft.stages": [[4, 1.0], [2, 0.4]], "sft.optimizer.decay_steps": 6}  # two stages, CI-sized
    one = _processes(1, 8, tmp_path / "one", "sft", {"one_process_cluster": True, **stages})[0]
    two = _processes(2, 4, tmp_path / "two", "sft", stages)
    assert two[0]["sft"] == two[1]["sft"]  # both processes read the same global scalars
    assert two[1]["written"] == []  # process 1 wrote nothing (no config.json, tokenizer, metrics)
    # the same batch at step 1: the same scalars
    first = [json.loads(open(tmp_path / run / "tensorboard" / "metrics.jsonl").readline()) for run in ("one", "two")]
    assert first[0]["step"] == first[1]["step"] == 1
    for key in ("sft/loss", "sft/grad_norm", "sft/token_prob_gt_half", "sft/param_norm"):
        assert first[1][key] == pytest.approx(first[0][key], rel=1e-6), key
    a, b = _load(tmp_path / "one" / "params.npz"), _load(tmp_path / "two" / "params.npz")
    assert a.keys() == b.keys()
    worst = max((float(np.abs(a[k] - b[k]).max()), k) for k in a)
    # measured: equal bit for bit after the :cpu variant's 40 steps. (A plain one-process run,
    # whose in-process all-reduce adds in another order, ended 5.6e-6 away after 40: Adam steps magnify that
    # rounding on embedding rows the batches hardly touch; docs/tpu.md)
    assert worst[0] <= 1e-5, f"parameters after SFT differ by {worst[0]:.2e} at {worst[1]}"
    assert one["sft"].keys() == two[0]["sft"].keys()


SHORT_SFT = {"sft.stages": [[6, 1.0]], "sft.optimizer.decay_steps": 6, "eval.before_sft": False}


def test_checkpoints_resume_across_process_counts(tmp_path):
    """A checkpoint written by 1 process restores on 2 with the same state (parameters, optimiser state, step), and
    one written by those 2 restores on 1 process: orbax writes and reads each process's shards."""
    workdir = tmp_path / "run"
    _processes(1, 8, workdir, "save", SHORT_SFT)
    saved_by_one = _load(workdir / "saved.npz")
    two = _processes(2, 4, workdir, "restore", SHORT_SFT)
    assert two[0]["restored"] == two[1]["restored"] == [3, {"eval/success": 0.5}]
    restored_on_two = _load(workdir / "restored.npz")
    saved_by_two = _load(workdir / "saved.npz")
    assert saved_by_one.keys() == restored_on_two.keys()
    for key in saved_by_one:
        np.testing.assert_array_equal(restored_on_two[key], saved_by_one[key], err_msg=key)
    assert any((saved_by_two[k] != saved_by_one[k]).any() for k in saved_by_one)  # two trained on
    assert [w for w in two[1]["written"] if not w.startswith("checkpoints")] == []
    one = _processes(1, 8, workdir, "restore", SHORT_SFT)[0]
    assert one["restored"] == [7, {}]
    restored_on_one = _load(workdir / "restored.npz")
    for key in saved_by_two:
        np.testing.assert_array_equal(restored_on_one[key], saved_by_two[key], err_msg=key)
