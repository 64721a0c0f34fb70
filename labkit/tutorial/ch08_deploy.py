"""The tutorial's deploy script (its chapter 8, ``deploy_vllm.sh``), as written, to hold our
deployment against (:ref:`ch08-tutorial-wrong`).

The script starts vLLM with its variables filled in and pipes it into ``tee``. Its server
command is :data:`TUTORIAL_SERVER_ARGS`, judged by vLLM's own parser
(``tests/engines/test_deploy_flags.py``); :data:`TUTORIAL_SCRIPT_PROBLEMS` says what is wrong
with each part of the script. The fix is :func:`labkit.deploy.deploy_script`, built from one
:class:`labkit.deploy.DeploymentSpec`.
"""

#: The server command of the tutorial's chapter 8 ``deploy_vllm.sh``, its variables filled
#: in, as the script runs it (``python -m vllm.entrypoints.openai.api_server``, then a pipe
#: into ``tee``). Kept to be judged by vLLM's own parser (tests/engines/test_deploy_flags.py).
TUTORIAL_SERVER_ARGS = (
    "--model", "meta-llama/Llama-3-70B-Instruct", "--served-model-name", "llama-70b",
    "--tensor-parallel-size", "4", "--port", "8000", "--max-model-len", "8192",
    "--gpu-memory-utilization", "0.90", "--quantization", "awq", "--dtype", "auto",
    "--trust-remote-code", "--disable-log-requests", "--max-num-seqs", "64",
    "--max-num-batched-tokens", "8192", "--swap-space", "4", "--enforce-eager",
)

#: What is wrong with the tutorial's script, and what :func:`labkit.deploy.deploy_script`
#: does instead.
TUTORIAL_SCRIPT_PROBLEMS = {
    "--disable-log-requests": "the default anyway: request logging is off unless "
                              "--enable-log-requests (engine/arg_utils.py); vllm 0.32.0's "
                              "parser rejects the flag, 0.33.0 accepts it again as the "
                              "negative of --enable-log-requests",
    "--swap-space": "gone from vLLM: its parser rejects it (0.32.0 and 0.33.0), no "
                    "swap_space option is left",
    "--trust-remote-code": "runs Python code from the model repository; Llama needs none",
    "--enforce-eager": "turns CUDA graphs off, slowing every decode step; a debugging flag",
    "python -m vllm.entrypoints.openai.api_server": "deprecated since vLLM 0.32.0, which "
                                                    "warns when started this way: the entry "
                                                    "point is `vllm serve`",
    "no --host": "vLLM binds (host or '', port), every interface, by default "
                 "(entrypoints/launchers/launcher.py); bind 127.0.0.1 behind a proxy",
    "no API key": "anyone who reaches the port can use the GPUs; VLLM_API_KEY from a secret",
    "| tee without pipefail": "the pipeline's status is tee's: a crashed server looks fine",
    "no health wait": "the script returns before the model is loaded (minutes for 70B)",
    "no stop": "nothing stops the server or its workers when the script is interrupted",
    "meta-llama/Llama-3-70B-Instruct": "not the id of Meta's repository "
                                       "(meta-llama/Meta-Llama-3-70B-Instruct), whose "
                                       "weights are BF16, not AWQ: --quantization awq needs "
                                       "an AWQ checkpoint",
}
