"""vLLM's offline ``LLM`` in its own environment, driven over a pipe (:ref:`ch02-vllm`, CPU path).

vLLM's CPU build lives in ``.venv-vllm``, apart from the lab's kernel, so a lab cannot import
it. This script runs there (``.venv-vllm/bin/python vllm_worker.py``; it needs only the
standard library and vLLM) and answers one JSON request per line on its standard input:

    {"op": "init", "kwargs": {...}}                     -> {"ok": true}
    {"op": "generate", "prompts": [...], "params": [...]} -> {"outputs": [...]}

Each answer is one JSON line on the original standard output; everything vLLM prints goes to
standard error, so it cannot corrupt the protocol. :class:`labkit.vllm_cpu.RemoteLLM` is the
other end.
"""

import json
import os
import sys


def _output(out) -> dict:
    return {"request_id": out.request_id, "prompt": out.prompt,
            "prompt_token_ids": list(out.prompt_token_ids or []),
            "num_cached_tokens": out.num_cached_tokens or 0, "finished": out.finished,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for c in out.outputs]}


def main() -> None:
    # Run as a script, this file's folder (labkit/) comes first on sys.path, and its http/
    # package would shadow the standard library's for everything vLLM imports.
    if os.path.samefile(sys.path[0] or ".", os.path.dirname(os.path.abspath(__file__))):
        del sys.path[0]
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's logs and prints go to stderr from here on
    from vllm import LLM, SamplingParams

    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "init":
                llm = LLM(**request["kwargs"])
                answer = {"ok": True}
            elif request["op"] == "generate":
                params = [SamplingParams(**p) for p in request["params"]]
                outputs = llm.generate(request["prompts"], params, use_tqdm=False)
                answer = {"outputs": [_output(o) for o in outputs]}
            else:
                answer = {"error": f"unknown op {request['op']!r}"}
        except Exception as err:  # noqa: BLE001 - the client re-raises it with its message
            answer = {"error": f"{type(err).__name__}: {err}"}
        protocol.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
