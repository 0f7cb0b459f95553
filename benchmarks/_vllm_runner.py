"""vLLM's CPU build as a peer of the benchmark: runs inside the vLLM venv, never in kvskill's.

Started by peers_bench.py with the venv's python. It builds one `vllm.LLM` for a checkpoint
directory (the job given as JSON in argv[1]), then serves runs: it reads one JSON line per run
on stdin ({"prompts", "max_tokens", "share_prefix"}) and answers one JSON line per run (tokens,
wall time, per-request TTFT, CPU seconds and peak RSS of its process tree) on the file
descriptor it was given; everything vLLM prints goes to stderr. Token ids go in, token ids come
out (no tokenizer); greedy, EOS ignored, so every request produces exactly its budget.

This file imports nothing from kvskill or the other benchmark modules: it runs under a
different venv (vLLM pins its own transformers).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _tree(root):
    return [root, *root.children(recursive=True)]


def _cpu_seconds(root) -> float:
    total = 0.0
    for p in _tree(root):
        try:
            t = p.cpu_times()
        except Exception:  # a helper process that exited between listing and reading
            continue
        total += t.user + t.system
    return total


def _reset_peaks(root) -> None:
    for p in _tree(root):
        try:
            with open(f"/proc/{p.pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def _peak_rss_mb(root) -> float:
    """Sum over the process tree of each process's high-water mark since the last reset."""
    total = 0
    for p in _tree(root):
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def main() -> int:
    job = json.loads(sys.argv[1])
    reply = os.fdopen(int(sys.argv[2]), "w", buffering=1)
    # Library output must not reach the reply channel.
    os.dup2(2, 1)

    import psutil
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=job["model_dir"],
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=job["block_size"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        max_num_seqs=job["max_num_seqs"],
        max_model_len=job["max_model_len"],
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        enable_prefix_caching=True,
        seed=0,
    )
    engine = llm.llm_engine
    me = psutil.Process()
    import vllm

    reply.write(
        json.dumps(
            {"ready": True, "load_s": time.perf_counter() - started, "vllm": vllm.__version__}
        )
        + "\n"
    )
    run_no = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        run_no += 1
        # Every run starts cold, like the other systems: nothing of the previous run's
        # prompts is reused. Inside a run, requests share cached prefix blocks unless
        # share_prefix is false, where each request gets its own cache salt (its block hashes
        # then match no other request's).
        llm.reset_prefix_cache()
        ids = []
        t_submit = time.perf_counter()
        cpu_before = _cpu_seconds(me)
        _reset_peaks(me)
        for i, (prompt, budget) in enumerate(zip(req["prompts"], req["max_tokens"], strict=True)):
            rid = f"r{run_no}-{i}"
            params = SamplingParams(
                max_tokens=budget, min_tokens=budget, temperature=0.0, ignore_eos=True
            )
            item = {"prompt_token_ids": prompt}
            if not req.get("share_prefix", True):
                item["cache_salt"] = rid
            engine.add_request(rid, item, params)
            ids.append(rid)
        first: dict[str, float] = {}
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                rid = out.request_id
                if rid not in first and out.outputs and out.outputs[0].token_ids:
                    first[rid] = time.perf_counter() - t_submit
                if out.finished:
                    done[rid] = list(out.outputs[0].token_ids)
        wall = time.perf_counter() - t_submit
        reply.write(
            json.dumps(
                {
                    "tokens": [done[r] for r in ids],
                    "wall_s": wall,
                    "ttft_s": [first[r] for r in ids],
                    "cpu_s": _cpu_seconds(me) - cpu_before,
                    "peak_rss_mb": _peak_rss_mb(me),
                }
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
