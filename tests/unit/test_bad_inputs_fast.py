"""Bad speculative configs fail fast, in the calling process, before any engine exists.

``eagle_vllm.LLM(target, speculative_config=...)`` must raise the plugin's
message, exit non-zero within seconds and leave no ``VLLM::EngineCore`` /
``VLLM::Worker`` process behind. ``eagle-vllm check-config FILE`` must print
the resolved config, or exit non-zero with the message.

Budget: importing vLLM costs ~10 s of CPU on this machine, and three fresh
interpreters on 2 busy cores took ~36 s each. So one fresh interpreter
(``subprocess.run([python, "-c", DRIVER], timeout=60)``) imports vLLM once and
then forks one child per bad config; each child calls ``LLM(...)`` as a user
script would and exits 1 on the exception (the interpreter's own status for an
uncaught exception). The driver is a child subreaper, so anything a child
starts and leaves behind is re-parented to it and reported. The time a user
would wait is ``import_s + the child's wall time``.

Guard: this file must never start an engine, so ``vllm.LLM.__init__`` is
replaced in the driver by a stub that exits 99; reaching it means validation
let a bad config through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import tiny_models
import torch
from tiny_models import build_draft, build_target

torch.set_num_threads(1)

PYTHON = sys.executable
EAGLE_VLLM = str(Path(PYTHON).with_name("eagle-vllm"))
TAG_VAR = "EAGLE_VLLM_BAD_INPUTS_TAG"
ENGINE_GUARD_RC = 99
MAX_WALL_S = 30.0

DRIVER = r"""
import ctypes, json, os, sys, time, traceback
t0 = time.monotonic()
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
import psutil
import vllm

def _no_engine(self, *args, **kwargs):
    print("ENGINE_WOULD_START " + json.dumps(kwargs, default=str), file=sys.stderr, flush=True)
    os._exit(ENGINE_GUARD_RC)

vllm.LLM.__init__ = _no_engine
from eagle_vllm import LLM

report = {"import_s": time.monotonic() - t0, "cases": {}}
target, cases, outdir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
for name, spec in cases.items():
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.path.join(outdir, name + ".stderr"), os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, 2)
        try:
            LLM(target, dtype="float32", max_model_len=512, enforce_eager=True, **spec)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        print("LLM_RETURNED", file=sys.stderr, flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    wall = time.monotonic() - start
    time.sleep(0.2)  # let orphans be re-parented to us
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            left.append(f"{p.pid} {p.name()} {' '.join(p.cmdline())}")
            p.kill()
        except psutil.Error:
            pass
    report["cases"][name] = {
        "rc": os.waitstatus_to_exitcode(status), "wall_s": wall, "leftovers": left,
    }
print("REPORT " + json.dumps(report), flush=True)
""".replace("ENGINE_GUARD_RC", str(ENGINE_GUARD_RC))


def tagged_processes(tag: str) -> list[str]:
    """Live processes that inherited ``tag`` through their environment."""
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if p.environ().get(TAG_VAR) == tag:
                found.append(f"{p.pid} {p.info['name']} {' '.join(p.info['cmdline'] or [])}")
        except (psutil.Error, OSError):
            continue
    return found


def vllm_engine_processes() -> set[int]:
    pids = set()
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        text = f"{p.info['name']} {' '.join(p.info['cmdline'] or [])}"
        if "VLLM::EngineCore" in text or "VLLM::Worker" in text:
            pids.add(p.info["pid"])
    return pids


def child_env(tag: str) -> dict[str, str]:
    env = {**os.environ, TAG_VAR: tag, "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_inputs")
    target = build_target(root / "target", layers=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_models, "HIDDEN", 128)
        draft_h128 = build_draft(root / "draft_h128", target)
    draft = build_draft(root / "draft", target)
    good = root / "good.yaml"
    good.write_text("method: eagle2\nmodel: draft\ntopk: 3\ntotal_tokens: 12\n")
    unknown_key = root / "unknown_key.yaml"
    unknown_key.write_text("method: eagle\nmodel: draft\nnum_speculative_token: 3\n")
    mismatch = root / "mismatch.yaml"
    mismatch.write_text("method: eagle\nmodel: draft_h128\n")
    return {
        "root": root,
        "target": target,
        "draft": draft,
        "draft_h128": draft_h128,
        "good": good,
        "unknown_key": unknown_key,
        "mismatch": mismatch,
    }


# name -> (keyword arguments of LLM(target, ...), fragments expected in stderr)
LLM_CASES = {
    "missing_draft": (
        lambda m: {
            "speculative_config": {"method": "eagle", "model": str(m["root"] / "no_such_draft")}
        },
        ["speculative config key 'model'", "no_such_draft", "does not exist", "Fix:"],
    ),
    "missing_speculative_model": (
        lambda m: {"speculative_model": str(m["root"] / "no_such_draft")},
        ["speculative config key 'model'", "no_such_draft", "does not exist", "Fix:"],
    ),
    "hidden_mismatch": (
        lambda m: {"speculative_config": {"method": "eagle2", "model": str(m["draft_h128"])}},
        ["speculative config key 'model'", "hidden_size 128", "target's 256", "Fix:"],
    ),
    "hidden_mismatch_yaml": (
        lambda m: {"speculative_config": str(m["mismatch"])},
        ["speculative config key 'model'", "hidden_size 128", "target's 256", "Fix:"],
    ),
    "unknown_key": (
        lambda m: {
            "speculative_config": {
                "method": "eagle",
                "model": str(m["draft"]),
                "num_spec_tokens": 3,
            }
        },
        ["speculative config key 'num_spec_tokens'", "unknown key", "Fix:"],
    ),
}
# a valid config: reaches the guard with the plugin's engine arguments
VALID_CASE = ("valid_control", lambda m: {"speculative_config": str(m["good"])})

CLI_CASES = {
    "good": (lambda m: [str(m["good"])], 0, []),
    "good_with_target": (lambda m: [str(m["good"]), "--target", str(m["target"])], 0, []),
    "unknown_key": (
        lambda m: [str(m["unknown_key"])],
        1,
        ["'num_speculative_token'", "unknown key", "Fix:"],
    ),
    "mismatch_with_target": (
        lambda m: [str(m["mismatch"]), "--target", str(m["target"])],
        1,
        ["hidden_size 128", "Fix:"],
    ),
    "missing_file": (lambda m: [str(m["root"] / "nope.yaml")], 1, ["does not exist", "Fix:"]),
}


def run_tagged(argv: list[str], timeout: float = 60, **kw) -> dict:
    tag = uuid.uuid4().hex
    start = time.monotonic()
    try:
        proc = subprocess.run(
            argv, env=child_env(tag), capture_output=True, text=True, timeout=timeout, **kw
        )
    except subprocess.TimeoutExpired as exc:
        return {"timeout": True, "argv": argv, "stderr": str(exc.stderr or "")[-3000:]}
    return {
        "timeout": False,
        "rc": proc.returncode,
        "stdout": proc.stdout,
        "stderr": proc.stderr,
        "wall_s": time.monotonic() - start,
        "leftovers": tagged_processes(tag),
    }


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    outdir = tmp_path_factory.mktemp("bad_inputs_stderr")
    engines_before = vllm_engine_processes()
    cases = {name: kwargs(models) for name, (kwargs, _) in LLM_CASES.items()}
    cases[VALID_CASE[0]] = VALID_CASE[1](models)
    driver_argv = [PYTHON, "-c", DRIVER, str(models["target"]), json.dumps(cases), str(outdir)]
    # the driver alone first (its import time is what a user waits for), then the CLI runs
    out = {"driver": run_tagged(driver_argv, cwd=models["root"])}
    with ThreadPoolExecutor(max_workers=len(CLI_CASES)) as pool:
        cli = {
            name: pool.submit(run_tagged, [EAGLE_VLLM, "check-config", *args(models)])
            for name, (args, _, _) in CLI_CASES.items()
        }
        out.update({f"cli:{n}": f.result() for n, f in cli.items()})
    d = out["driver"]
    assert not d["timeout"], f"driver timed out:\n{d['stderr']}"
    reports = [line for line in d["stdout"].splitlines() if line.startswith("REPORT ")]
    assert d["rc"] == 0 and reports, f"driver failed (rc {d['rc']}):\n{d['stderr'][-3000:]}"
    report = json.loads(reports[-1].removeprefix("REPORT "))
    out["import_s"] = report["import_s"]
    for name, res in report["cases"].items():
        res["stderr"] = (outdir / f"{name}.stderr").read_text()
        out[f"llm:{name}"] = res
    out["new_engines"] = sorted(vllm_engine_processes() - engines_before)
    return out


@pytest.mark.parametrize("case", list(LLM_CASES))
def test_llm_fails_fast(runs, case):
    run = runs[f"llm:{case}"]
    err = run["stderr"]
    assert run["rc"] != ENGINE_GUARD_RC and "ENGINE_WOULD_START" not in err, (
        "validation let a bad config through to vllm.LLM"
    )
    assert "LLM_RETURNED" not in err
    assert run["rc"] == 1, err[-3000:]
    assert "EagleConfigError" in err, err[-3000:]
    for fragment in LLM_CASES[case][1]:
        assert fragment in err, f"{fragment!r} not in stderr:\n{err[-3000:]}"
    # validation itself is instant; a user also waits for `import vllm`
    assert run["wall_s"] < 2.0, f"validation took {run['wall_s']:.1f} s"
    assert runs["import_s"] + run["wall_s"] < MAX_WALL_S, (
        f"import {runs['import_s']:.1f} s + {run['wall_s']:.1f} s"
    )
    assert not run["leftovers"], f"left behind: {run['leftovers']}"


def test_valid_config_reaches_vllm_with_plugin_arguments(runs, models):
    """Positive control for the guard: a good config gets through, mapped onto vLLM."""
    run = runs[f"llm:{VALID_CASE[0]}"]
    assert run["rc"] == ENGINE_GUARD_RC, run["stderr"][-3000:]
    line = next(x for x in run["stderr"].splitlines() if x.startswith("ENGINE_WOULD_START "))
    kwargs = json.loads(line.removeprefix("ENGINE_WOULD_START "))
    draft = str((models["root"] / "draft").resolve())
    assert kwargs["speculative_config"] == {
        "method": "eagle",
        "model": draft,
        "num_speculative_tokens": 11,
        "disable_eagle_block_drop": True,
    }
    assert kwargs["worker_cls"] == "eagle_vllm.engine.worker.EagleWorker"
    plugin = kwargs["additional_config"]["eagle_vllm"]
    assert (plugin["method"], plugin["topk"], plugin["total_tokens"]) == ("eagle2", 3, 12)
    assert kwargs["max_model_len"] == 512 and kwargs["dtype"] == "float32"
    assert not run["leftovers"]


def test_no_processes_left_behind(runs):
    assert not runs["driver"]["leftovers"], runs["driver"]["leftovers"]
    for name in CLI_CASES:
        assert not runs[f"cli:{name}"]["leftovers"]
    # an engine that appeared meanwhile must be the other tests' (it lacks our tag)
    for pid in runs["new_engines"]:
        try:
            tag = psutil.Process(pid).environ().get(TAG_VAR)
        except (psutil.Error, OSError):
            continue  # gone already, or not ours to read
        assert tag is None, f"engine process {pid} was started by this test"


def test_check_config_prints_resolved_config(runs, models):
    run = runs["cli:good"]
    assert not run["timeout"] and run["rc"] == 0, run["stderr"]
    lines = dict(line.split(": ", 1) for line in run["stdout"].strip().splitlines())
    assert lines == {
        "method": "eagle2",
        "model": str((models["root"] / "draft").resolve()),
        "num_speculative_tokens": "4",
        "topk": "3",
        "total_tokens": "12",
        "draft_sample_method": "greedy",
        "root_topk": "3",
        "draft_vocab": "0",
        "draft_vocab_context": "False",
        "auto_size": "False",
        "sizing_profile": "None",
        "suffix": "None",
        "source": str(models["good"]),
        "head_type": "eagle1",
        "draft_dtype": "model",
    }
    assert run["wall_s"] < MAX_WALL_S


def test_check_config_with_target(runs):
    run = runs["cli:good_with_target"]
    assert not run["timeout"] and run["rc"] == 0, run["stderr"]
    assert "method: eagle2" in run["stdout"] and "total_tokens: 12" in run["stdout"]


@pytest.mark.parametrize("case", [c for c, v in CLI_CASES.items() if v[1] != 0])
def test_check_config_rejects_bad_file(runs, case):
    run = runs[f"cli:{case}"]
    assert not run["timeout"]
    assert run["rc"] != 0, run["stdout"]
    assert "method:" not in run["stdout"]  # nothing printed as if it were valid
    for fragment in CLI_CASES[case][2]:
        assert fragment in run["stderr"], f"{fragment!r} not in stderr:\n{run['stderr'][-3000:]}"
    assert run["wall_s"] < MAX_WALL_S
