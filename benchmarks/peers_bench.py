"""Peer benchmark: kvskill's runtime against transformers and vLLM's CPU build, same checkpoint.

Every system loads one checkpoint per model, saved once by this script from the seeded
random-weight reference (`~/.cache/kvskill-bench/checkpoints/`), gets token ids (no
tokenizer), decodes greedily with EOS ignored, and runs in fp32. Systems:

- `kvskill`: the runtime as a user gets it (`LLM`, paged KV, prefix caching on, the fast
  paths this machine allows); on W5 also `kvskill_nopc` (prefix caching off);
- `kvskill_exact`: `exact=True` (the model's own code bit for bit, no fast path);
- `kvskill_prepack`: only `prepack_linear=True` (oneDNN linear layers with weights
  reordered at load time, not bit-exact against the default MKL path);
- `kvskill_fused`: `prepack_linear=True` and `fuse_layers=True` (RMSNorm and SiLU x up in
  one-pass compiled kernels, within fp32 rounding of the default path);
- `kvskill_screen`: `kvskill_fused` with `screen_output_head=True` (greedy steps read the
  output head in bf16 and compute fp32 logits only for the tokens a rounding bound keeps;
  each token the exact argmax of fp32 dot products); on W5 also `kvskill_screen_nopc`;
- `kvskill_graph`: the defaults with `graph=True` (decode steps replay a graph captured per
  batch bucket); its process captures every bucket the workload's batch can reach before it
  answers ready, as vLLM compiles its model at start-up, so no capture falls in a timed run;
- `hf_padded`: transformers' padded `generate`, all requests in one batch;
- `hf_cb`: transformers' continuous batching, when the installed transformers has it;
- `vllm`: vLLM's CPU build, in its own venv and process (`_vllm_runner.py`, built by
  `vllm_venv.py`), prefix caching on; on W5 also `vllm_nopc` (a cache salt per request, so
  no request reuses another's blocks). Skipped with the reason when its venv is absent.

Every system runs in a process of its own: kvskill's and transformers' in `_system_worker.py`
(kvskill's python, one process per system and workload, sized for that workload), vLLM in
its runner (its venv, one process per model and thread count). A process that is not being
timed is stopped (SIGSTOP), so it takes no CPU from the one that is. Per workload every system
gets a warm-up run, then rounds: each round runs every system once, the order rotated by one
each round, and records the load average before it. Reported per system: useful tokens/s,
mean TTFT, useful tokens per CPU-second (the runner's user + system time, over vLLM's process
tree), peak RSS during the run (the runner's high-water mark, reset before each run; summed
over vLLM's processes) and requests whose tokens equal kvskill's and vLLM's.

Not a `bench_*` script: `make bench` (run_all.py) does not run it; `make bench-peers` does.

    python benchmarks/peers_bench.py                            # default plan
    python benchmarks/peers_bench.py --models qwen3-0.6b-8l --threads 2 --workloads W2 --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import (  # noqa: E402
    BLOCK_SIZE,
    MODELS,
    PEER_ONLY_MODELS,
    TOKEN_BUDGET,
    Workload,
    environment,
    kv_bytes_per_token,
    load_average,
    make_workload,
    set_threads,
)

RESULTS_DIR = HERE / "results"
ALL_MODELS = {**MODELS, **PEER_ONLY_MODELS}
#: vLLM's CPU attention takes block sizes that are multiples of 32 only ("No common block
#: size for 16 (CPU_ATTN: [MultipleOf(32)])"); the others page in blocks of BLOCK_SIZE.
VLLM_BLOCK_SIZE = 32
PEER_MODELS = ("qwen3-4l-h256", "qwen3-0.6b-8l")
PEER_WORKLOADS = ("W1", "W2", "W5")
#: every fast path off, for the systems that turn on some of them only
_OFF = {"prepack_linear": False, "fuse_layers": False, "screen_output_head": False}
_FAST = {"prepack_linear": True, "fuse_layers": True}
_SCREEN = {**_FAST, "screen_output_head": True}
#: kvskill's systems: the runtime's options each one runs with
KVSKILL_OPTIONS = {
    "kvskill": {},
    "kvskill_nopc": {"enable_prefix_caching": False},
    "kvskill_exact": {"exact": True},
    "kvskill_prepack": {**_OFF, "prepack_linear": True},
    "kvskill_fused": {**_OFF, **_FAST},
    "kvskill_screen": _SCREEN,
    "kvskill_screen_nopc": {**_SCREEN, "enable_prefix_caching": False},
    "kvskill_graph": {"graph": True},
}
SYSTEMS = (*KVSKILL_OPTIONS, "hf_padded", "hf_cb", "vllm", "vllm_nopc")
#: Systems that only differ from another one by prefix caching run on W5 only.
_W5_ONLY = ("kvskill_nopc", "kvskill_screen_nopc", "vllm_nopc")


def make_w5(vocab: int, *, requests: int = 32, prefix_len: int = 1024, max_tokens: int = 32):
    """Issue 25's W5: one shared prefix + 16-64 own tokens per request, each -> max_tokens."""
    from bench_prefix_cache import make_w5 as prompts_w5

    prompts = prompts_w5(vocab, requests=requests, prefix_len=prefix_len)
    demand = sum(-(-(len(p) + max_tokens) // BLOCK_SIZE) + 1 for p in prompts) * BLOCK_SIZE
    return Workload(
        name="W5",
        description=(
            f"shared prefix: {requests} requests, {prefix_len}-token prefix + 16-64 own "
            f"tokens -> {max_tokens}"
        ),
        prompts=prompts,
        max_tokens=[max_tokens] * requests,
        kv_capacity_tokens=demand,
    )


def get_workload(name: str, vocab: int) -> Workload:
    return make_w5(vocab) if name == "W5" else make_workload(name, vocab)


# --- checkpoints -------------------------------------------------------------------------


def cache_root() -> Path:
    return Path(os.environ.get("KVSKILL_BENCH_CACHE", Path.home() / ".cache" / "kvskill-bench"))


def checkpoint_dir(spec) -> Path:
    """Where `spec`'s checkpoint lives; the name changes whenever its config or seed does."""
    key = json.dumps({"t": spec.model_type, "o": spec.overrides, "s": spec.seed}, sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return cache_root() / "checkpoints" / f"{spec.name}-{digest}"


def ensure_checkpoint(spec) -> Path:
    """Save the seeded reference once (safetensors + config.json); later runs reuse it."""
    from _common import build_reference_model

    path = checkpoint_dir(spec)
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    model = build_reference_model(spec)
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def load_reference(path: Path):
    """The checkpoint in transformers (fp32, sdpa): padded generate, continuous batching and
    kvskill (which takes this model's tensors) all read these weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


# --- every system in a process of its own -----------------------------------------------


def _die_with_parent() -> None:
    """In the runner, before it starts: the kernel kills it when the benchmark dies. A runner
    that is stopped (SIGSTOP) when its parent is killed would otherwise stay forever, holding
    gigabytes (SIGKILL reaches a stopped process; SIGTERM waits for SIGCONT)."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class PeerProcess:
    """A system's runner process: it answers one JSON line per job on the file descriptor it
    was given, and is stopped (SIGSTOP to its process group) while the other systems run, so
    an idle runner takes no CPU from the one being timed (vLLM's idle worker took about 0.1
    CPU-second per second, measured here)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_name: str):
        read_fd, write_fd = os.pipe()
        self.log_path = cache_root() / log_name
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [*cmd, str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_path, "a"),  # noqa: SIM115
            pass_fds=(write_fd,),
            env=env,
            text=True,
            # its own process group: the runner and any process it starts are stopped together
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.ready = self._reply()
        self.pause()

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        # (a runner that has exited is reported by _reply)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def _reply(self) -> dict:
        line = self.replies.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the runner exited ({code}); see {self.log_path}")
        return json.loads(line)

    def ask(self, job: dict) -> dict:
        self.resume()
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            return self._reply()
        finally:
            self.pause()

    def close(self) -> None:
        try:
            self.resume()
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()


class VllmPeer(PeerProcess):
    """vLLM's runner process for one checkpoint at one thread count (its own venv)."""

    def __init__(self, python: Path, model_dir: Path, *, threads: int, workloads, bpt: int):
        capacity = max(w.kv_capacity_tokens for w in workloads)
        longest = max(
            len(p) + m for w in workloads for p, m in zip(w.prompts, w.max_tokens, strict=True)
        )
        job = {
            "model_dir": str(model_dir),
            "block_size": VLLM_BLOCK_SIZE,
            "max_num_batched_tokens": TOKEN_BUDGET,
            "max_num_seqs": 256,
            "max_model_len": -(-longest // VLLM_BLOCK_SIZE) * VLLM_BLOCK_SIZE,
            # The same pool as kvskill's (the largest workload's), plus a block per request.
            "kv_cache_bytes": (capacity + 64 * VLLM_BLOCK_SIZE) * bpt,
        }
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            # vLLM binds its OpenMP threads to cores; these are the first `threads` cores.
            VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_LOGGING_LEVEL="WARNING",
        )
        env.pop("PYTHONPATH", None)
        cmd = [str(python), str(HERE / "_vllm_runner.py"), json.dumps(job)]
        super().__init__(cmd, env, "vllm-runner.log")
        self.version = self.ready.get("vllm")

    def run(self, workload: Workload, *, share_prefix: bool = True) -> dict:
        return self.ask(
            {
                "prompts": workload.prompts,
                "max_tokens": workload.max_tokens,
                "share_prefix": share_prefix,
            }
        )


class SystemPeer(PeerProcess):
    """One of kvskill's configurations or a transformers path serving one workload, in a
    process of its own (``_system_worker.py``, this venv's python)."""

    def __init__(self, system: str, model: str, ckpt: Path, workload: Workload, threads: int):
        job = {
            "system": system,
            "model": model,
            "checkpoint": str(ckpt),
            "kv_capacity_tokens": workload.kv_capacity_tokens,
            "num_requests": workload.num_requests,
            "threads": threads,
        }
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        cmd = [sys.executable, str(HERE / "_system_worker.py"), json.dumps(job)]
        super().__init__(cmd, env, "system-runner.log")

    def run(self, workload: Workload) -> dict:
        return self.ask({"prompts": workload.prompts, "max_tokens": workload.max_tokens})


# --- one cell: a model at a thread count ---------------------------------------------------


def make_runners(systems, model: str, ckpt: Path, workload, threads: int, vllm):
    """name -> (callable Workload -> measurement dict, close or None); errors by name."""
    runners, errors = {}, {}
    for name in systems:
        try:
            if name in ("vllm", "vllm_nopc"):
                if vllm is None:
                    raise RuntimeError("vLLM's venv is not built")
                share = name == "vllm"
                runners[name] = ((lambda wl, s=share: vllm.run(wl, share_prefix=s)), None)
            elif name in SYSTEMS:
                peer = SystemPeer(name, model, ckpt, workload, threads)
                runners[name] = (peer.run, peer.close)
            else:
                raise ValueError(f"unknown system {name!r}")
        except Exception as exc:  # one system that cannot run must not hide the others
            errors[name] = f"{type(exc).__name__}: {exc}"
    return runners, errors


def run_cell(
    model: str, threads: int, workloads, systems, rounds: int, vllm_python, save=None
) -> dict:
    """Run the cell; ``save(result)`` is called after every timed run with what is measured
    so far, so a cell stopped early still leaves its finished runs."""
    warnings.filterwarnings("ignore")
    set_threads(threads)
    spec = ALL_MODELS[model]
    ckpt = ensure_checkpoint(spec)
    wls = [get_workload(name, spec.vocab_size) for name in workloads]
    vllm, vllm_error = None, None
    if vllm_python is not None and any(s.startswith("vllm") for s in systems):
        try:
            vllm = VllmPeer(
                Path(vllm_python),
                ckpt,
                threads=threads,
                workloads=wls,
                bpt=kv_bytes_per_token(spec),
            )
        except Exception as exc:
            vllm_error = f"{type(exc).__name__}: {exc}"
    records = []
    try:
        for wl in wls:
            chosen = [s for s in systems if wl.name == "W5" or s not in _W5_ONLY]
            runners, errors = make_runners(chosen, model, ckpt, wl, threads, vllm)
            if vllm_error:
                errors.update({s: vllm_error for s in chosen if s.startswith("vllm")})
                for s in list(runners):
                    if s.startswith("vllm"):
                        del runners[s]
            closers = {n: c for n, (_f, c) in runners.items() if c is not None}
            try:
                runs: dict[str, list[dict]] = {s: [] for s in runners}
                for name, (fn, _close) in list(runners.items()):
                    try:
                        fn(wl.warmup())
                    except Exception as exc:
                        errors[name] = f"{type(exc).__name__}: {exc}"
                        del runners[name]
                order = list(runners)
                for r in range(rounds):
                    shift = r % max(1, len(order))
                    for name in order[shift:] + order[:shift]:
                        if name in errors:
                            continue
                        load = load_average()
                        try:
                            m = runners[name][0](wl)
                        except Exception as exc:
                            errors[name] = f"{type(exc).__name__}: {exc}"
                            continue
                        m.update(round=r, load_average=load)
                        runs[name].append(m)
                        if save is not None:
                            partial = _summarise(wl, model, threads, chosen, runs, errors)
                            done = [p for p in partial if "error" not in p]
                            save({"records": records + done, "vllm": vllm and vllm.version})
                        print(
                            f"[{model} t={threads} {wl.name} r{r}] {name:13s} "
                            f"{wl.useful_tokens / m['wall_s']:7.1f} tok/s  load {load}",
                            file=sys.stderr,
                            flush=True,
                        )
            finally:
                # every runner process ends with its workload, a failed one too
                for name, close in closers.items():
                    try:
                        close()
                    except Exception as exc:
                        errors.setdefault(name, f"close: {type(exc).__name__}: {exc}")
            records += _summarise(wl, model, threads, chosen, runs, errors)
    finally:
        if vllm is not None:
            vllm.close()
    return {"records": records, "vllm": None if vllm is None else vllm.version}


def _summarise(wl: Workload, model, threads, systems, runs, errors) -> list[dict]:
    def first_tokens(system: str):
        done = runs.get(system) or []
        return done[0]["tokens"] if done else None

    def matches(tokens, ref_tokens):
        if ref_tokens is None:
            return None
        return sum(a == b for a, b in zip(tokens, ref_tokens, strict=True))

    ref_tokens, vllm_tokens = first_tokens("kvskill"), first_tokens("vllm")
    out = []
    for name in systems:
        base = {"model": model, "threads": threads, "workload": wl.name, "system": name}
        if name in errors or not runs.get(name):
            out.append(base | {"error": errors.get(name, "no run")})
            continue
        ms = runs[name]
        walls = [m["wall_s"] for m in ms]
        tokens = ms[0]["tokens"]
        out.append(
            base
            | {
                "rounds": len(ms),
                "useful_tokens": wl.useful_tokens,
                "tokens_per_s": wl.useful_tokens / statistics.median(walls),
                "ttft_s": statistics.median(statistics.fmean(m["ttft_s"]) for m in ms),
                "tokens_per_cpu_s": wl.useful_tokens * len(ms) / sum(m["cpu_s"] for m in ms),
                "peak_rss_mb": max(m["peak_rss_mb"] for m in ms),
                "deterministic": all(m["tokens"] == tokens for m in ms),
                "lengths_ok": [len(t) for t in tokens] == wl.max_tokens,
                "match_kvskill": matches(tokens, ref_tokens),
                "match_vllm": matches(tokens, vllm_tokens),
                "num_requests": wl.num_requests,
                "per_round": [
                    {
                        "round": m["round"],
                        "wall_s": round(m["wall_s"], 3),
                        "cpu_s": round(m["cpu_s"], 2),
                        "load_average": m["load_average"],
                    }
                    for m in ms
                ],
            }
        )
    return out


# --- the whole run ------------------------------------------------------------------------


def _load_note(result: dict) -> str:
    """Whether other work shared the cores, from the load average before the run started
    (during it the benchmark's own threads raise it to about its thread count)."""
    before = (result.get("load_average_before") or [None])[0]
    if before is None:
        return "Load before the run unknown."
    if before > 1.0:
        return (
            f"The 1-min load average was {before} when the run started: other work was running "
            "or had just ended (a decaying average), so the cores may have been shared."
        )
    return "Started on an otherwise idle machine."


def markdown(result: dict) -> str:
    lines = [
        f"Peer benchmark, {result['date']} — {result['machine']['cores']} cores "
        f"({result['machine']['cpu']}); torch {result['versions']['torch']}, transformers "
        f"{result['versions']['transformers']}, vLLM {result.get('vllm') or '-'}, kvskill "
        f"{result['versions']['kvskill_commit']}. {_load_note(result)} Load average "
        f"before/after {result['load_average_before']} / {result['load_average_after']}, per "
        "round in the JSON. Every system ran in a process of its own; ratios compare runs of the "
        "same minutes; absolute numbers are noisy.",
        "",
        "| model | thr | workload | system | tok/s | vs kvskill | mean TTFT s | tok/CPU-s "
        "| peak RSS MB | match kvskill | match vLLM | loads (1-min) per round |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    rows = result["records"]
    rates = {
        (r["model"], r["threads"], r["workload"]): r["tokens_per_s"]
        for r in rows
        if r["system"] == "kvskill" and "error" not in r
    }
    for r in rows:
        head = f"| {r['model']} | {r['threads']} | {r['workload']} | {r['system']} "
        if "error" in r:
            lines.append(head + f"| - | - | - | - | - | skipped: {r['error']} | - | - |")
            continue
        kv = rates.get((r["model"], r["threads"], r["workload"]))
        loads = ", ".join(str(p["load_average"][0]) for p in r["per_round"] if p["load_average"])
        lines.append(
            head + f"| {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / kv:.2f} "
            if kv
            else head + f"| {r['tokens_per_s']:.1f} | - "
        )
        lines[-1] += (
            f"| {r['ttft_s']:.2f} | {r['tokens_per_cpu_s']:.1f} | {r['peak_rss_mb']:.0f} "
            f"| {_match(r, 'match_kvskill')} | {_match(r, 'match_vllm')} | {loads} |"
        )
    return "\n".join(lines) + "\n"


def _match(record: dict, key: str) -> str:
    """ "equal/requests", or "-" when the system compared with did not run (older results
    have no vLLM comparison at all)."""
    found = record.get(key)
    return "-" if found is None else f"{found}/{record['num_requests']}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(PEER_MODELS))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--workloads", default=",".join(PEER_WORKLOADS))
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-build", action="store_true", help="never build the vLLM venv")
    p.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--cell", help=argparse.SUPPRESS)  # model:threads, run in this process
    p.add_argument("--cell-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--vllm-python", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS] + [
        w for w in workloads if w not in PEER_WORKLOADS
    ]
    if bad:
        print(f"error: unknown system or workload {bad}", file=sys.stderr)
        return 2
    if args.cell:
        model, threads = args.cell.split(":")

        def save(result: dict) -> None:
            args.cell_out.write_text(json.dumps(result))

        result = run_cell(
            model, int(threads), workloads, systems, args.rounds, args.vllm_python, save
        )
        save(result)
        return 0

    import vllm_venv

    vllm_python, vllm_skip = None, None
    if any(s.startswith("vllm") for s in systems):
        vllm_skip = vllm_venv.missing_reason()
        if vllm_skip and not args.no_build:
            vllm_venv.main([])
            vllm_skip = vllm_venv.missing_reason()
        if vllm_skip is None:
            vllm_python = str(vllm_venv.venv_python())
    started = dt.datetime.now(dt.timezone.utc)
    load_before = load_average()
    records, vllm_version = [], None
    for model in args.models.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = Path(f.name)
            cmd = [
                sys.executable, __file__, "--cell", f"{model}:{threads}", "--cell-out", str(out),
                "--workloads", ",".join(workloads), "--systems", ",".join(systems),
                "--rounds", str(args.rounds),
            ]  # fmt: skip
            if vllm_python:
                cmd += ["--vllm-python", vllm_python]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
            env.setdefault("HF_HUB_OFFLINE", "1")
            env.setdefault("TRANSFORMERS_OFFLINE", "1")
            proc = subprocess.run(cmd, env=env)
            if proc.returncode != 0 and out.stat().st_size:
                # Stopped early: keep the runs it finished, mark it.
                cell = json.loads(out.read_text())
                for r in cell["records"]:
                    r["cell_stopped_early"] = proc.returncode
                records += cell["records"]
                vllm_version = vllm_version or cell["vllm"]
                continue
            if proc.returncode != 0 or not out.stat().st_size:
                records += [
                    {
                        "model": model,
                        "threads": threads,
                        "workload": w,
                        "system": s,
                        "error": f"cell exited {proc.returncode}",
                    }
                    for w in workloads
                    for s in systems
                ]
                continue
            cell = json.loads(out.read_text())
            out.unlink()
            vllm_version = vllm_version or cell["vllm"]
            records += cell["records"]
    if vllm_skip:
        for r in records:
            if r["system"].startswith("vllm") and "error" in r:
                r["error"] = vllm_skip
    env_info = environment()
    result = {
        "benchmark": "peers_bench",
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "vllm": vllm_version,
        "vllm_venv": vllm_venv.stamp(),
        "settings": {
            "rounds": args.rounds,
            "block_size": BLOCK_SIZE,
            "token_budget": TOKEN_BUDGET,
            "models": {m: ALL_MODELS[m].note for m in args.models.split(",")},
        },
        **env_info,
        "records": records,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    (args.out_dir / f"peers_bench-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "peers_bench.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
