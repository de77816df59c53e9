"""Which server flags `scripts/start_vllm.sh` chooses for a model directory: with the tokenizer (and the Hermes
tool-call parser for a Hermes-style chat template) when the directory has one, token ids only otherwise or when
asked. A stand-in `VLLM_PYTHON` records the command line and answers /health, so no vLLM starts here (the real
server on a trained policy: test_served_policy.py)."""
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

from tests.backends.conftest import REPO

HERMES_TEMPLATE = "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{% endfor %}" \
                  "{% endfor %}"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def write_fake_vllm_python(directory, probe: str = "sys.exit(1)"):
    """An executable standing in for vLLM's python: `-c ...` (start_vllm.sh's probes) runs `probe` (by default it
    fails, as the CUDA probe does on this machine), `-m vllm... serve` writes its arguments to $FAKE_VLLM_ARGV and
    serves /health until stopped."""
    script = directory / "fake_vllm_python"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""
        import http.server, json, os, sys
        if sys.argv[1] == "-c":
            PROBE
        args = sys.argv[1:]
        with open(os.environ["FAKE_VLLM_ARGV"], "w") as fh:
            json.dump(args, fh)
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Health).serve_forever()
    """).replace("PROBE", probe))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


@pytest.fixture
def fake_vllm(tmp_path):
    return write_fake_vllm_python(tmp_path)


def launch(tmp_path, fake_vllm, model_dir, *extra, **env):
    """Starts the script on `model_dir` with the stand-in; returns (the server's arguments, the script's stderr)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv_file = tmp_path / f"argv-{port}.json"
    run_env = {**os.environ, "VLLM_PYTHON": str(fake_vllm), "AGENTFLY_VLLM_RUN_DIR": str(tmp_path / "run"),
               "FAKE_VLLM_ARGV": str(argv_file), "VLLM_START_TIMEOUT": "30", **env}
    try:
        proc = subprocess.run(["bash", str(REPO / "scripts/start_vllm.sh"), str(model_dir), str(port), *extra],
                              env=run_env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(argv_file.read_text()), proc.stderr
    finally:
        subprocess.run(["bash", str(REPO / "scripts/stop_vllm.sh"), str(port)], env=run_env, capture_output=True,
                       timeout=60)


def model_dir(tmp_path, name, template=None, tokenizer=True):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    if tokenizer:
        (directory / "tokenizer.json").write_text("{}")
        (directory / "tokenizer_config.json").write_text("{}")
    if template is not None:
        (directory / "chat_template.jinja").write_text(template)
    return directory


def test_a_tokenizer_and_a_hermes_template_give_chat_with_tool_parsing(tmp_path, fake_vllm):
    args, messages = launch(tmp_path, fake_vllm, model_dir(tmp_path, "policy", HERMES_TEMPLATE))
    assert "--skip-tokenizer-init" not in args
    assert args[args.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in args
    # what VLLMBackend relies on stays on
    for flag in ("--worker-extension-cls", "--return-tokens-as-token-ids", "--generation-config"):
        assert flag in args
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "hermes parser" in messages


def test_a_template_in_tokenizer_config_counts_too(tmp_path, fake_vllm):
    directory = model_dir(tmp_path, "policy")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": HERMES_TEMPLATE}))
    args, _ = launch(tmp_path, fake_vllm, directory)
    assert args[args.index("--tool-call-parser") + 1] == "hermes"


def test_a_plain_template_gives_chat_without_tool_parsing(tmp_path, fake_vllm):
    args, messages = launch(tmp_path, fake_vllm, model_dir(tmp_path, "policy", PLAIN_TEMPLATE))
    assert "--skip-tokenizer-init" not in args and "--tool-call-parser" not in args
    assert "--enable-auto-tool-choice" not in args and "without tool-call parsing" in messages


def test_no_tokenizer_or_asked_to_skip_gives_token_ids_only(tmp_path, fake_vllm):
    args, messages = launch(tmp_path, fake_vllm, model_dir(tmp_path, "bare", tokenizer=False))
    assert "--skip-tokenizer-init" in args and "--tool-call-parser" not in args and "token ids" in messages
    args, _ = launch(tmp_path, fake_vllm, model_dir(tmp_path, "policy", HERMES_TEMPLATE),
                     AGENTFLY_VLLM_TOKENIZER="skip")
    assert "--skip-tokenizer-init" in args and "--tool-call-parser" not in args
    args, _ = launch(tmp_path, fake_vllm, model_dir(tmp_path, "policy2", HERMES_TEMPLATE), "--skip-tokenizer-init")
    assert args.count("--skip-tokenizer-init") == 1 and "--tool-call-parser" not in args


def test_the_tool_parser_can_be_chosen_or_turned_off(tmp_path, fake_vllm):
    directory = model_dir(tmp_path, "policy", HERMES_TEMPLATE)
    args, _ = launch(tmp_path, fake_vllm, directory, AGENTFLY_VLLM_TOOL_PARSER="none")
    assert "--tool-call-parser" not in args and "--skip-tokenizer-init" not in args
    args, _ = launch(tmp_path, fake_vllm, directory, AGENTFLY_VLLM_TOOL_PARSER="qwen3_xml")
    assert args[args.index("--tool-call-parser") + 1] == "qwen3_xml"
    args, _ = launch(tmp_path, fake_vllm, directory, "--enable-auto-tool-choice", "--tool-call-parser=pythonic")
    assert "--tool-call-parser" not in args and "--tool-call-parser=pythonic" in args
    assert args.count("--enable-auto-tool-choice") == 1


def test_an_unknown_tokenizer_mode_is_refused(tmp_path, fake_vllm):
    proc = subprocess.run(["bash", str(REPO / "scripts/start_vllm.sh"), str(model_dir(tmp_path, "p")), "1"],
                          env={**os.environ, "VLLM_PYTHON": str(fake_vllm), "AGENTFLY_VLLM_TOKENIZER": "yes",
                               "AGENTFLY_VLLM_RUN_DIR": str(tmp_path / "run")},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "AGENTFLY_VLLM_TOKENIZER" in proc.stderr


def test_the_server_environment_holds_bytecode_for_what_a_server_imports():
    """scripts/setup_vllm.sh compiles .venv-vllm/ once: uv writes no bytecode and with PYTHONDONTWRITEBYTECODE set
    each of a server's three processes compiled vllm's and torch's sources again (docs/benchmarks.md, "vLLM server
    start")."""
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.fail("no .venv-vllm/: run scripts/setup.sh (scripts/setup_vllm.sh builds it)")
    probe = ("import importlib.util, os, sys\n"
             "for name in ('vllm.entrypoints.openai.api_server', 'vllm.v1.engine.core', 'torch.nn.modules.linear'):\n"
             "    spec = importlib.util.find_spec(name)\n"
             "    cached = importlib.util.cache_from_source(spec.origin)\n"
             "    print(name, os.path.isfile(cached))\n")
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300, check=True).stdout
    missing = [line.split()[0] for line in out.splitlines() if line.split()[1] != "True"]
    assert not missing, f"no bytecode for {missing}: rerun scripts/setup_vllm.sh"
