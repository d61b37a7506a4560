"""transformers + peft models under FSDP1's documented recipe, with torch's FSDP1 class switched to
fsdp_compat's by the public ``fsdp_compat.torch_patched()`` (see ``test_lightning_fabric.py`` for
what it rebinds). The code below only names torch: ``torch.distributed.fsdp.FullyShardedDataParallel``,
``MixedPrecision``, ``transformer_auto_wrap_policy``, ``apply_activation_checkpointing``.

Models are tiny and built from configs (never downloaded): GPT-2 (tied input/output embeddings) and
Llama. torch's FSDP1 crashes (SIGSEGV) running this flow on CPU with torch 2.13, so the oracles are
the unwrapped model: the FULL state dict loads strictly into it, trained parameters changed, frozen
ones did not, tied weights stay tied, and (in fp32) ``generate`` under ``summon_full_params`` gives
the unwrapped model's tokens.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers", reason="needs the integration extra: pip install -e '.[integration]'")
pytest.importorskip("peft", reason="needs the integration extra: pip install -e '.[integration]'")

import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fsdp_compat.testing import distributed_test

from ._common import full_state, run_flow

STEPS, VOCAB = 3, 64

ARCHS = {
    "gpt2": (lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                                n_positions=32)), GPT2Block, ["c_attn"]),
    "llama": (lambda: LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=2, num_key_value_heads=1,
                                                   vocab_size=VOCAB, max_position_embeddings=32)),
              LlamaDecoderLayer, ["q_proj", "v_proj"]),
}


def _build(arch: str, lora: bool) -> nn.Module:
    torch.manual_seed(0)
    build, _, targets = ARCHS[arch]
    model = build()
    model.config.use_cache = False
    if lora:  # frozen base, trainable adapters
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    return model


def _hf_flow(arch: str, lora: bool, bf16: bool):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    block = ARCHS[arch][1]
    model = FSDP(
        _build(arch, lora),
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None,
        use_orig_params=True, device_id=torch.device("cpu"))
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, block))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = full_state(model)
    with FSDP.summon_full_params(model, writeback=False):
        prompt = torch.arange(4).unsqueeze(0)
        generated = model.module.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                          max_new_tokens=4, do_sample=False, pad_token_id=0)
    return losses, state, generated


CASES = {
    "gpt2-full-finetune-bf16": ("gpt2", False, True),
    "llama-lora": ("llama", True, False),
    "gpt2-lora-bf16": ("gpt2", True, True),
}
@pytest.mark.parametrize("case", list(CASES))
@distributed_test(world_size=2)
def test_hf_model_trains_checkpoints_and_generates(case):
    arch, lora, bf16 = CASES[case]
    losses, state, generated = run_flow(_hf_flow, arch, lora, bf16, ours=True)
    assert all(torch.isfinite(torch.tensor(losses)))
    plain = _build(arch, lora)
    plain.load_state_dict(state, strict=True)  # FULL state dict into the unwrapped HF model
    trained = [n for n, p in plain.named_parameters() if p.requires_grad]
    initial = _build(arch, lora).state_dict()
    assert all(not torch.equal(state[n], initial[n]) for n in trained), "a trainable parameter did not train"
    frozen = [n for n, p in plain.named_parameters() if not p.requires_grad]
    assert all(torch.equal(state[n], initial[n]) for n in frozen), "a frozen parameter changed"
    if arch == "gpt2":
        assert torch.equal(state[_key(state, "lm_head.weight")], state[_key(state, "wte.weight")])
    assert generated.shape == (1, 8)
    if not bf16:
        prompt = torch.arange(4).unsqueeze(0)
        with torch.no_grad():
            expected = plain.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(generated, expected)


def _key(state: dict, suffix: str) -> str:
    return next(k for k in state if k.endswith(suffix))
