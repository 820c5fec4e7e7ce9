"""A policy with arguments through `LLM`: preemptive shortest-remaining-time-first whose
predictions age (`aging` tokens of priority per second waited) and that never forces out a running
request (`preempt_running=False`). The keys of `policy_config` are the fields of the policy's
config dataclass (`SRPTConfig` in policies/policy/srpt.py, the same keys as conf/policy/srpt.yaml);
an unknown one is a ValueError naming it.
"""
from __future__ import annotations

from engine import LLM, SamplingParams


def generate_with_srpt(model: str = "tiny-llama") -> list[list[int]]:
    llm = LLM(model, device="cpu", num_gpu_blocks=64, max_model_len=256,
              policy="srpt", policy_config={"aging": 1.0, "preempt_running": False})
    outputs = llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]
