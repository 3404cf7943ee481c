"""finetune dpo: one fp32 step equals TRL's DPOTrainer; 2 ranks == 1 process; resume exact with precomputed
reference log-probs; the LoRA reference is the base with adapters off (FSDP2, 2 ranks); bad rows exit 2 or are
dropped and counted."""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from finetune.tasks.dpo import LABELLERS
from helpers import BASE, invoke, losses, read_metrics, run_ranks, write_jsonl

WORDS = "alpha beta gamma delta echo fox golf hotel india juliet kilo lima mike".split()


def make_pairs(n: int, seed: int = 0) -> list[dict]:
    """TRL's conversational shape (prompt messages, chosen / rejected as one assistant message); some with a system
    prompt and an earlier turn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        if i % 4 == 1:
            prompt += [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        prompt.append({"role": "user", "content": f"Repeat {q}?"})
        rows.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": q}],
                     "rejected": [{"role": "assistant", "content": " ".join(rng.sample(WORDS, rng.randint(1, 6)))}]})
    return rows


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", make_pairs(32))


def dpo_rank(cfg):
    from finetune.train import train
    return train(cfg, "dpo")


def dpo(model_dir, data, out, *overrides, nproc: int = 1) -> list[dict]:
    from finetune.args import build_config
    cfg = build_config(None, [*BASE, "train.lr=1e-3", *map(str, overrides)],
                       **{"model.path": str(model_dir), "data.path": str(data), "output_dir": str(out)})
    run_ranks(dpo_rank, nproc, cfg)
    return read_metrics(out)


def test_one_step_matches_trl_dpo_trainer(llama_dir, tmp_path):
    """8 pairs, beta 0.1, fp32, one process: one AdamW step, then the second step's loss, rewards and grad norm as
    TRL's (the first step's are trivial: policy == reference, loss ln 2), and the same trained tokens (the llama3
    template ends a turn with <|eot_id|>, so TRL's prompt+completion rendering and our inference-exact completion
    agree; a template that writes text after its end-of-turn token, e.g. ChatML's newline, differs there)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from finetune.data import IGNORE_INDEX
    from finetune.tasks.pairs import label_pair
    rows = make_pairs(8, seed=1)
    data = tmp_path / "pairs.jsonl"
    write_jsonl(data, rows)
    ours = dpo(llama_dir, data, tmp_path / "ours", "train.max_steps=2", "train.micro_batch_size=8", "train.beta2=0.999",
               "train.eps=1e-8", "train.weight_decay=0", "data.packing=false", "data.max_seq_len=1024",
               "train.max_grad_norm=1e6")

    tok = AutoTokenizer.from_pretrained(llama_dir)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, per_device_train_batch_size=8, max_steps=2,
                     learning_rate=1e-3, lr_scheduler_type="constant", adam_beta2=0.999, adam_epsilon=1e-8,
                     weight_decay=0.0, max_grad_norm=1e6, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                     max_length=None, dataloader_num_workers=0, save_strategy="no")
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tok)
    for row, tokenized in zip(rows, trainer.train_dataset):  # the trained tokens of each side
        sample = label_pair(tok, row, "row", 4096).samples[0]
        n = sample["starts"][1]
        for side, labels in (("chosen", sample["labels"][:n]), ("rejected", sample["labels"][n:])):
            assert [t for t in labels if t != IGNORE_INDEX] == tokenized[f"{side}_ids"]
    trainer.train()
    theirs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(ours) == len(theirs) == 2 and theirs[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)
    for key, trl_key in (("loss", "loss"), ("rewards_chosen", "rewards/chosen"),
                         ("rewards_rejected", "rewards/rejected"), ("margin", "rewards/margins"),
                         ("accuracy", "rewards/accuracies"), ("grad_norm", "grad_norm")):
        assert [r[key] for r in ours] == pytest.approx([r[trl_key] for r in theirs], abs=1e-5), key
    assert theirs[1]["rewards/margins"] > 1e-3  # not trivially equal


def test_two_ranks_equal_one_process_and_resume_is_exact(llama_dir, pairs_file, tmp_path):
    """Packed pairs, precomputed reference log-probs (the 2-rank pass sharded and gathered); the resumed run reads
    ref_logps.pt instead of recomputing from the trained model."""
    one = dpo(llama_dir, pairs_file, tmp_path / "one", "train.max_steps=4", "train.micro_batch_size=2",
              "data.max_seq_len=512", "checkpoint.interval=2")
    two = dpo(llama_dir, pairs_file, tmp_path / "two", "train.max_steps=4", "train.micro_batch_size=1",
              "data.max_seq_len=512", nproc=2)
    assert one[0]["loss"] == pytest.approx(0.6931472, abs=1e-6) and one[0]["accuracy"] == 0  # policy == reference
    assert one[-1]["loss"] < one[0]["loss"] and one[-1]["accuracy"] > 0.5
    for key in ("loss", "rewards_chosen", "rewards_rejected", "accuracy", "grad_norm"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-4, abs=1e-6), key
    out = tmp_path / "resumed"  # the one-process run as it stood after step 2 (constant lr: a 2-step run)
    shutil.copytree(tmp_path / "one", out)
    shutil.rmtree(out / "checkpoints" / "step-4")
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in (out / "metrics.jsonl").read_text()
                                               .splitlines()[:2]))
    table = (out / "checkpoints" / "ref_logps.pt").stat().st_mtime_ns
    dpo(llama_dir, pairs_file, out, "train.max_steps=4", "train.micro_batch_size=2", "data.max_seq_len=512")
    assert (out / "checkpoints" / "ref_logps.pt").stat().st_mtime_ns == table  # reused, not recomputed
    assert losses(out) == losses(tmp_path / "one")


def lora_reference(model_dir, data, *extra):
    """(rank) pair log-probs of a LoRA model (adapters and trained copies of lora.modules_to_save, `extra`, made to
    differ from the base) with adapters off, with them on, and of the plain model without LoRA: all under FSDP2."""
    from finetune.args import build_config
    from finetune.distributed import init_distributed
    from finetune.tasks.dpo import adapters_off, collate_pairs, pair_logps
    from finetune.build import transforms
    from finetune.data.chat_template import run_tokenizer
    from finetune.task import build_run_samples
    from finetune.train import build_model_and_optimizer
    device, dims = init_distributed(1, 0)
    results = []
    for rank in (4, 0):
        cfg = build_config(None, [*BASE, f"lora.rank={rank}", "data.packing=false", "data.max_seq_len=512",
                                  *(extra if rank else ())],
                           **{"model.path": str(model_dir), "data.path": str(data), "output_dir": "unused"})
        tok, _ = run_tokenizer(cfg)
        model, _, _ = build_model_and_optimizer(cfg, device, dims, transforms(cfg, dims, device))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.to_local().normal_(std=0.05)
                elif ".modules_to_save." in name:
                    p.to_local().add_(torch.randn_like(p.to_local()), alpha=0.05)
        items = [x for _, x in zip(range(4), build_run_samples(cfg, tok, rank=dims.dp_rank, world_size=dims.dp_size,
                                                              shuffle=False, labellers=LABELLERS))]
        batch = collate_pairs(items, tok.pad_token_id)
        with torch.no_grad():
            if rank:
                with adapters_off(model):
                    results.append(pair_logps(model, batch).tolist())  # no tensors across processes
            results.append(pair_logps(model, batch).tolist())  # no tensors across processes
    return results


@pytest.mark.parametrize("extra", [(), ("lora.modules_to_save=['lm_head']",), ("lora.target_modules=['experts']",)],
                         ids=["adapters", "lm_head_saved", "experts"])
def test_lora_reference_is_the_base_with_adapters_off(llama_dir, pairs_file, extra, tmp_path):
    """With lora.modules_to_save the reference also uses the frozen original module, not the trained copy; with LoRA
    on the experts only (Qwen3-MoE) their adapters are off too."""
    from test_moe import make_moe_dir
    model_dir = make_moe_dir(tmp_path / "moe", "qwen3_moe", num_layers=1) if "experts" in str(extra) else llama_dir
    for off, on, base in run_ranks(lora_reference, 2, model_dir, pairs_file, *extra):
        off, on, base = map(torch.tensor, (off, on, base))
        assert torch.allclose(off, base, atol=1e-5)
        assert not torch.allclose(on, base, atol=1e-3)  # the adapters do change the log-probs


BAD = [{"prompt": "Say hi.", "chosen": "hi"},  # missing side
       {"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
        "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]},  # prompt mismatch
       {"prompt": "Say hi.", "chosen": "hi", "rejected": "  "}]  # empty completion


def test_bad_rows_stop_naming_the_line_or_are_dropped_and_counted(llama_dir, tmp_path):
    from finetune.data import build_samples
    from finetune.model import load_tokenizer
    good = make_pairs(4)
    data = tmp_path / "bad.jsonl"
    for k, (bad, reason) in enumerate(zip(BAD, ("missing_side", "prompt_mismatch", "empty_completion"))):
        write_jsonl(data, good[:2] + [bad] + good[2:])
        tok = load_tokenizer(str(llama_dir))
        samples = build_samples(str(data), tok, on_unsupported="drop", max_seq_len=256, labellers=LABELLERS)
        assert samples.counts["kept"] == 4 and samples.counts[f"dropped_{reason}"] == 1
        if k == 0:  # through the command (refused before any rank starts): one line naming the file and line, exit 2
            result = invoke("dpo", "--model", llama_dir, "--dataset", data, "--output-dir", tmp_path / "out", *BASE)
            assert result.exit_code == 2, result.output[-2000:]
            line = result.stderr.strip().splitlines()[-1]
            assert line.startswith("error: ") and f"{data}:3:" in line and "missing_side" in line
        else:
            with pytest.raises(Exception, match=f"{data}:3: .*{reason}"):
                build_samples(str(data), tok, max_seq_len=256, labellers=LABELLERS)


def test_sft_and_dpo_refuse_each_others_data(llama_dir, pairs_file, chat_file, tmp_path):
    from helpers import invoke
    result = invoke("sft", "--model", llama_dir, "--dataset", pairs_file, "-o", tmp_path / "a", *BASE)
    assert result.exit_code == 2 and "finetune dpo" in result.stderr
    result = invoke("dpo", "--model", llama_dir, "--dataset", chat_file, "-o", tmp_path / "b", *BASE)
    assert result.exit_code == 2 and "'chosen' and 'rejected'" in result.stderr


def test_losses_and_rewards_follow_their_formulas(monkeypatch):
    """sigmoid with label smoothing against the precomputed reference; SimPO on mean log-probs with its margin."""
    import torch.nn.functional as F

    from finetune.tasks import dpo
    from finetune.config import DPOConfig
    logps = torch.tensor([[-3.0, -5.0], [-4.0, -2.0]])
    monkeypatch.setattr(dpo, "pair_logps", lambda model, batch: logps)
    batch = {"ref_logps": torch.tensor([[-3.5, -4.0], [-4.0, -2.5]], dtype=torch.float64),
             "seq_tokens": torch.tensor([[2.0, 4.0], [1.0, 2.0]], dtype=torch.float64)}
    loss, stats = dpo.make_loss(DPOConfig(beta=0.5, label_smoothing=0.1), "precomputed")(None, batch)
    rewards = 0.5 * (logps - batch["ref_logps"].float())
    z = rewards[:, 0] - rewards[:, 1]
    assert loss.item() == pytest.approx((-0.9 * F.logsigmoid(z) - 0.1 * F.logsigmoid(-z)).sum().item())
    assert [stats[k].item() for k in ("count", *dpo.MEANS)] == pytest.approx(
        [2, rewards[:, 0].sum().item(), rewards[:, 1].sum().item(), 1, (rewards[:, 0] - rewards[:, 1]).sum().item()])
    loss, stats = dpo.make_loss(DPOConfig(loss="simpo", beta=2.0, simpo_gamma=0.5), None)(None, batch)
    mean = logps / batch["seq_tokens"].float()
    assert loss.item() == pytest.approx(-F.logsigmoid(2 * (mean[:, 0] - mean[:, 1]) - 0.5).sum().item())
    assert [stats[k].item() for k in ("count", *dpo.MEANS[:3])] == pytest.approx(
        [2, 2 * (-1.5 - 4), 2 * (-1.25 - 1), 0])  # mean log-probs x beta


def test_pairs_without_reference_log_probs_stop_in_one_line(llama_dir, pairs_file):
    """A resumed run whose data holds a pair its precomputed table lacks (the data changed) stops in one line; a table
    that fills in (bench's zeros) serves any pair."""
    from collections import defaultdict

    from finetune.config import ConfigError
    from finetune.data import build_samples
    from finetune.tasks.dpo import collate_pairs
    from finetune.model import load_tokenizer
    tok = load_tokenizer(str(llama_dir))
    items = list(build_samples(str(pairs_file), tok, max_seq_len=256, shuffle=False, epoch_limit=1,
                                labellers=LABELLERS))[:2]
    keys = [(s["source"], s["row"]) for item in items for s in item["sources"]]
    table = {k: [-1.0, -2.0] for k in keys}
    batch = collate_pairs(items, tok.pad_token_id, table=table)
    assert batch["ref_logps"].tolist() == [[-1.0, -2.0]] * len(keys)
    del table[keys[-1]]
    with pytest.raises(ConfigError, match=rf"ref_logps.pt has no reference log-probs for row {keys[-1][1]} of "
                                          r"source .*: the data changed since they were computed"):
        collate_pairs(items, tok.pad_token_id, table=table)
    zeros = collate_pairs(items, tok.pad_token_id, table=defaultdict(lambda: [0.0, 0.0]))
    assert zeros["ref_logps"].abs().sum() == 0


def last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_a_run_continues_only_a_run_of_its_task_and_model(llama_dir, chat_file, pairs_file, tmp_path):
    """dpo into an sft run's output dir (resumed or not), sft into a dpo run's, --resume-from a checkpoint of another
    task or of another model: refused at start-up in one line, exit 2, with a hint for what was asked."""
    import json

    from conftest import make_model_dir
    from finetune.checkpoint import MARKER, read_marker
    from helpers import invoke, sft
    sft_out = tmp_path / "sft"
    sft(llama_dir, chat_file, sft_out, "train.max_steps=1")
    step = sft_out / "checkpoints" / "step-1"
    hint = "and pass DIR as --model, with another --output-dir"
    for extra in ((), ("--no-resume",)):
        result = invoke("dpo", "--model", llama_dir, "--dataset", pairs_file, "-o", sft_out, *BASE, *extra)
        assert result.exit_code == 2 and last_line(result) == (
            f"error: output_dir {sft_out} holds a `finetune sft` run (step-1); `finetune dpo` continues only dpo runs "
            f"and keeps its own output dir: to start dpo from that model, export it (finetune export-hf --checkpoint "
            f"{sft_out} -o DIR) {hint}"), result.stderr
    assert [p.name for p in (sft_out / "checkpoints").iterdir()] == ["step-1"]  # nothing moved
    result = invoke("dpo", "--model", llama_dir, "--dataset", pairs_file, "-o", tmp_path / "dpo", "--resume-from",
                    step, *BASE)
    assert result.exit_code == 2 and last_line(result) == (
        f"error: checkpoint.resume_from: {step} is a checkpoint of a `finetune sft` run; `finetune dpo` continues only "
        f"dpo runs and keeps its own output dir: to start dpo from that model, export it (finetune export-hf "
        f"--checkpoint {step} -o DIR) {hint}"), result.stderr
    other = make_model_dir(tmp_path / "other", "llama3", "llama", tied=False, seed=1)  # same architecture
    result = invoke("sft", "--model", other, "--dataset", chat_file, "-o", tmp_path / "sft2", "--resume-from", step,
                    *BASE)
    trained = read_marker(step)["config"]["model"]["path"]
    assert result.exit_code == 2 and last_line(result) == (
        f"error: checkpoint.resume_from: {step}: its run trained the model '{trained}', not '{other}' (model.path): "
        f"to continue that run, pass --model {trained}; to start a new run from its weights, export it (finetune "
        f"export-hf --checkpoint {step} -o DIR) and pass DIR as --model"), result.stderr
    marker = json.loads((step / MARKER).read_text())  # as a dpo run's (test_no_resume_moves_... checks one's)
    assert marker["task"] == "sft"
    (step / MARKER).write_text(json.dumps({**marker, "task": "dpo"}))
    result = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "-o", sft_out, *BASE)
    assert result.exit_code == 2 and "holds a `finetune dpo` run (step-1); `finetune sft` continues only sft runs" \
        in last_line(result), result.stderr


def test_reference_log_probs_are_refused_on_pairs_edited_in_place(llama_dir, tmp_path):
    """ref_logps.pt holds a digest of each pair's tokens: a resume on the same pairs (a file rewritten, its mtime
    new) reads it; on pairs edited in place (sides swapped, rows moved) it is refused in one line."""
    from finetune.config import ConfigError
    rows = make_pairs(8, seed=2)
    data, out = write_jsonl(tmp_path / "pairs.jsonl", rows), tmp_path / "run"
    run = ("train.micro_batch_size=2", "data.max_seq_len=512")
    dpo(llama_dir, data, out, "train.max_steps=2", *run)
    write_jsonl(data, rows)  # the same pairs, written again
    assert [r["step"] for r in dpo(llama_dir, data, out, "train.max_steps=3", *run)] == [1, 2, 3]
    write_jsonl(data, [{**rows[1], "chosen": rows[1]["rejected"], "rejected": rows[1]["chosen"]}, rows[0], *rows[2:]])
    with pytest.raises(ConfigError, match=rf"^{out}/checkpoints/ref_logps.pt was computed on other pairs than the "
                                          rf"data holds now: 2 of the 8 pairs are not those it holds \(e.g. {data} row "
                                          rf"[01]\), .*: resume on the data they were computed on, or start afresh "
                                          rf"\(--no-resume\)$"):
        dpo(llama_dir, data, out, "train.max_steps=4", *run)


def test_no_resume_moves_the_reference_aside_with_its_checkpoints(llama_dir, tmp_path):
    """--no-resume moves ref_logps.pt aside with the checkpoints it belongs to: the kept run, resumed, uses its own
    reference (the step as it trained straight), not the newer run's, and keeps it beside its new checkpoints."""
    from finetune.checkpoint import read_marker
    data, other = (write_jsonl(tmp_path / f"{n}.jsonl", make_pairs(8, seed=s)) for n, s in (("pairs", 2), ("other", 3)))
    out = tmp_path / "run"
    run = ("train.micro_batch_size=2", "data.max_seq_len=512", "checkpoint.interval=1")
    straight = dpo(llama_dir, data, out, "train.max_steps=3", *run)
    dpo(llama_dir, other, out, "train.max_steps=1", "checkpoint.resume=false", *run)  # another run, other pairs
    kept = out / "checkpoints.1"
    resumed = dpo(llama_dir, data, out, "train.max_steps=3", "checkpoint.resume=false",
                  f"checkpoint.resume_from={kept}/step-2", *run)
    assert resumed[-1]["step"] == 3
    for key in ("loss", "rewards_chosen", "rewards_rejected", "grad_norm"):
        assert resumed[-1][key] == pytest.approx(straight[2][key], rel=1e-6), key
    assert sorted(p.name for p in kept.iterdir()) == ["ref_logps.pt", "step-2", "step-3"]
    tables = torch.load(kept / "ref_logps.pt", weights_only=False)
    assert torch.load(out / "checkpoints" / "ref_logps.pt", weights_only=False) == tables  # beside the new steps
    assert torch.load(out / "checkpoints.2" / "ref_logps.pt", weights_only=False) != tables  # the other run's
    assert read_marker(kept / "step-3")["task"] == "dpo"  # (test_a_run_continues_only_... refuses sft here)


@pytest.mark.parametrize("override, line", [
    ("dpo.label_smoothing=0.1", "dpo.label_smoothing=0.1 has no effect on dpo.loss=simpo (reference-free, no label "
                                "smoothing): leave it at 0.0, or set dpo.loss=sigmoid"),
    ('dpo.reference="precomputed"', "dpo.reference='precomputed' has no effect on dpo.loss=simpo (reference-free, no "
                                    "label smoothing): leave it at 'auto', or set dpo.loss=sigmoid"),
    ("dpo.simpo_gamma=-0.5", "dpo.simpo_gamma must be >= 0 (SimPO's target margin: a negative one rewards a chosen "
                             "answer less likely than the rejected), got -0.5")])
def test_simpo_refuses_what_it_would_ignore_or_invert(tmp_path, override, line):
    """Issue 53: SimPO has no reference and no label smoothing; these trained as if unset, without a word."""
    result = invoke("dpo", "-o", tmp_path / "run", "train.max_steps=1", "dpo.loss=simpo", override)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {line}"]
    assert not (tmp_path / "run").exists()
