"""The fine-tuning path end to end, the Hugging Face way: a small random Llama-family model built
and saved with `transformers`, fine-tuned 20 steps by GPUMix on a 3-rank uneven ZeRO-3 plan with a
local tokenizer.json and a JSON Lines dataset, exported, loaded back with `transformers`: its
logits equal GPUMix's final model's (the checkpoint read through the runtime)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from executor.launch import launch_run
from executor.store import read_metrics
from contracts.cluster import ClusterSpec, DeviceSpec, NodeSpec
from contracts.plan import Assignment, Plan

pytestmark = pytest.mark.slow

VOCAB = 384
SEQ = 32
STEPS = 20


def _texts() -> list[str]:
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    out = []
    for name in sorted(os.listdir(root))[:60]:
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as fh:
                out.append(fh.read()[:4000])
    return out


def _tokenizer(path: str, texts: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(path)


def _hf_model(folder: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)


def _plan(model: str) -> Plan:
    devices = (DeviceSpec("cpu"),) * 3
    cluster = ClusterSpec("test", (NodeSpec("localhost", "local", devices),))
    pieces = [(2, 1, 0.5), (1, 2, 0.3), (1, 1, 0.2)]
    asg = tuple(Assignment(i, "localhost", "cpu", m, k, m * k, f, 0, 0.0) for i, (m, k, f) in enumerate(pieces))
    return Plan(cluster, model, 5, SEQ, "fp32", "none", asg, 0.0, 0.0, zero=3)


def test_fine_tune_a_transformers_model_and_export_it(tmp_path, data_dir):
    from transformers import AutoModelForCausalLM

    from executor.hf_io import export_run
    from models.collectives import LocalCollectives
    from models.sharded import ShardedRuntime
    from executor import checkpoint as ckpt
    from contracts.specs import get_model

    texts = _texts()
    hf_dir, out_dir, run = str(tmp_path / "hf"), str(tmp_path / "export"), str(tmp_path / "run")
    _hf_model(hf_dir)
    tok_path = str(tmp_path / "tokenizer.json")
    _tokenizer(tok_path, texts)
    data = str(tmp_path / "data.jsonl")
    with open(data, "w", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}) + "\n")
    model = os.path.join(hf_dir, "config.json")
    status = launch_run(_plan(model), STEPS, run, seed=1, checkpoint_every=STEPS, corpus_dir=data,
                        tokenizer=tok_path, init_from=hf_dir)
    m = read_metrics(run)
    assert status == "done", m["reason"]
    losses = [s["loss"] for s in m["steps"]]
    assert len(losses) == STEPS and losses[-1] < losses[0]

    export_run(run, out_dir)
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(out_dir))
    hf = AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32).eval()

    spec = get_model(model)
    rt = ShardedRuntime(spec, zero=1, fractions=[1.0], position=0, comm=LocalCollectives(0, 1),
                        device=torch.device("cpu"), materialize=False)
    ckpt.load(run, rt, 0)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = rt.model(x)
        theirs = hf(x).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    # and the run really moved the weights away from the transformers model it started from
    start = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        assert (start(x).logits - theirs).abs().max().item() > 1e-3
