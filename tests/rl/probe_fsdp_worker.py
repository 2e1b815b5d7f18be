"""`isotrain rl ARGV` on a forked rank whose syncs to isotrain's own engine are followed by the vLLM engine's probe.

Launched by test_moe_engine_sync.py:  probe_fsdp_worker.py ARGV...  The probe (rl/sync_check.py) is the one a vLLM
run makes after every sync; run here against `rollout.engine=hf` (its log-probs equal the trainer's), it costs no
vLLM engine, and the steps after it train on whatever FSDP2 state it left.
"""

from __future__ import annotations

import sys

import isotrain.cli
from isotrain.recipes.rl import RL
from isotrain.rl.generate import encode_prompts
from isotrain.rl.sync_check import probe

sync_weights = RL._sync_weights


def sync_and_probe(self, when: str) -> None:
    sync_weights(self, when)
    prompt = encode_prompts(self.tokenizer, self.prompts.prompts[:1])[0]
    gap = probe(self.engine, self.model, prompt, self.cfg.rl.max_new_tokens, 1e-5, self.ctx.device, when,
                self.ctx.options.autocast_dtype, self.ctx.layout)
    print(f"probe {when}: {gap:.3g}", flush=True)


RL._sync_weights = sync_and_probe
isotrain.cli.main(sys.argv[1:])
