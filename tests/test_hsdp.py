"""HSDP and the data-parallel layout (in-process gloo ranks): HSDP 2x2 == FSDP 1x4 == 1 process; exact resume across
meshes; the FSDP units (embeddings and lm_head apart when untied; Liger); a [parallel] layout that does not fit the
ranks; two "nodes" (launchers) on localhost stopped by SLURM's SIGUSR1."""
from __future__ import annotations

import os
import signal

import pytest

from finetune.config import ConfigError
from finetune.distributed import free_port
from finetune.errors import ModelError
from helpers import BASE, cli_process, invoke, losses, read_metrics, run_ranks, sft, sft_config, train_rank

MESHES = {"2x2": ("parallel.dp_replicate=2",), "1x4": (), "4x1": ("parallel.dp_replicate=4",)}
FOUR_RANKS = ("train.micro_batch_size=1",)  # global batch 4 at every layout
ONE_RANK = ("train.micro_batch_size=4",)


def close(a: list[dict], b: list[dict], key: str) -> bool:
    return [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5)


def test_hsdp_2x2_equals_fsdp_1x4_equals_one_process_and_resumes_across_meshes(llama_dir, chat_file, tmp_path):
    """Five fp32 steps at three layouts agree (losses, grad norms, label tokens); then a run that moves
    2x2 (steps 1-2) -> 1x4 (3) -> 4x1 (4) -> 1 process (5) through its checkpoints equals them too: DCP reshards
    the weights and optimizer state, and the data position is global."""
    one = sft(llama_dir, chat_file, tmp_path / "one", "train.max_steps=5", *ONE_RANK)
    saves = {"2x2": ("checkpoint.interval=2", "checkpoint.keep=0"), "1x4": ()}  # step-2 of 2x2: the moved run's start
    runs = {name: sft(llama_dir, chat_file, tmp_path / name, "train.max_steps=5", *FOUR_RANKS, *MESHES[name],
                      *saves[name], nproc=4) for name in ("2x2", "1x4")}
    assert one[-1]["loss"] < one[0]["loss"]
    for name, recs in runs.items():
        assert [r["num_tokens"] for r in recs] == [r["num_tokens"] for r in one], name
        assert close(recs, one, "loss") and close(recs, one, "grad_norm"), name
    moved = tmp_path / "moved"
    start = tmp_path / "2x2" / "checkpoints" / "step-2"
    for step, name, nproc in ((3, "1x4", 4), (4, "4x1", 4), (5, "1", 1)):
        layout = (*FOUR_RANKS, *MESHES[name]) if nproc == 4 else ONE_RANK
        sft(llama_dir, chat_file, moved, f"train.max_steps={step}", *layout, "checkpoint.interval=1",
            "checkpoint.keep=0", f"checkpoint.resume_from={start}", nproc=nproc)
        start = moved / "checkpoints" / f"step-{step}"
    recs = read_metrics(moved)
    assert [r["step"] for r in recs] == [3, 4, 5]
    assert [r["num_tokens"] for r in recs] == [r["num_tokens"] for r in one[2:]]
    assert close(recs, one[2:], "loss") and close(recs, one[2:], "grad_norm")


def fsdp_layout(model_dir: str, dp_replicate: int, liger: bool = False) -> dict:
    """The FSDP units of a model built on this rank's mesh ({unit: its parameters}) and the parameters' placements."""
    from torch.distributed.fsdp import FSDPModule

    from finetune.distributed import init_distributed
    from finetune.model import build_model
    from finetune.weights import clean_fqn
    device, dims = init_distributed(dp_replicate)
    from finetune.config import load_config
    from finetune.build import transforms
    t = transforms(load_config(None, {"model.liger": liger}), dims, device)
    model, _ = build_model(model_dir, device, dims.mesh, t, mixed_precision="fp32")
    units, seen = {}, set()
    for name, mod in reversed(list(model.named_modules())):  # innermost first: a unit owns what no inner unit owns
        if isinstance(mod, FSDPModule):
            own = {clean_fqn(n if not name else f"{name}.{n}") for n, p in mod.named_parameters()} - seen
            units[clean_fqn(name) or "<root>"] = sorted(own)
            seen |= own
    placements = {str(p.placements) for p in model.parameters()}
    return {"units": units, "placements": placements, "dp_rank": dims.dp_rank, "dp_size": dims.dp_size}


def test_units_embeddings_apart_when_untied_together_when_tied_on_a_2d_mesh(llama_dir, qwen_tied_dir):
    untied, tied = run_ranks(fsdp_layout, 4, str(llama_dir), 2)[1], run_ranks(fsdp_layout, 4, str(qwen_tied_dir), 2)[2]
    assert untied["placements"] == tied["placements"] == {"(Replicate(), Shard(dim=0))"}
    assert (untied["dp_rank"], untied["dp_size"], tied["dp_rank"]) == (1, 4, 2)
    assert untied["units"]["model.embed_tokens"] == ["model.embed_tokens.weight"]
    assert untied["units"]["lm_head"] == ["lm_head.weight"]
    assert untied["units"]["<root>"] == ["model.norm.weight"]
    assert "model.embed_tokens" not in tied["units"] and "lm_head" not in tied["units"]
    assert tied["units"]["<root>"] == ["model.embed_tokens.weight", "model.norm.weight"]  # lm_head.weight is it
    assert sum(name.startswith("model.layers.") for name in untied["units"]) == 4


def test_tied_model_trains_as_one_process_on_a_2d_mesh(qwen_tied_dir, chat_file, tmp_path):
    one = sft(qwen_tied_dir, chat_file, tmp_path / "one", "train.max_steps=3", *ONE_RANK)
    hsdp = sft(qwen_tied_dir, chat_file, tmp_path / "hsdp", "train.max_steps=3", *FOUR_RANKS, *MESHES["2x2"], nproc=4)
    assert close(hsdp, one, "loss") and close(hsdp, one, "grad_norm")


@pytest.mark.parametrize("override, message", [
    ("parallel.dp_replicate=3", "parallel.dp_replicate=3 does not divide the 2 launched ranks"),
    ("parallel.dp_shard=4", "parallel.dp_replicate x parallel.dp_shard = 1 x 4 = 4, but 2 ranks were launched"),
])
def test_a_layout_that_does_not_fit_the_ranks_is_one_line_and_exit_2(llama_dir, chat_file, tmp_path, override,
                                                                      message):
    result = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", tmp_path / "run",
                    "--nproc-per-node", 2, *BASE, override)
    assert result.exit_code == 2 and result.stderr.strip() == f"error: {message}"
    assert not (tmp_path / "run").exists()
    if override.endswith("=3"):  # ranks started by another launcher (torchrun) check it against their group
        with pytest.raises(ConfigError, match=message):
            run_ranks(train_rank, 2, sft_config(llama_dir, chat_file, tmp_path / "run", override))


def test_liger_fused_cross_entropy_and_rope_train_as_the_plain_path_on_two_ranks(llama_dir, chat_file, tmp_path):
    """Triton's interpreter runs Liger's fused linear cross-entropy and RoPE kernels on CPU tensors. The fused loss
    reads lm_head.weight in the model's forward, so lm_head stays in the root unit (all-gathered there): the losses
    and grad norms are the plain path's. (conftest starts every test process in Triton's interpreter when there is
    no CUDA.)"""
    run = ("train.max_steps=2", "train.micro_batch_size=1", "data.max_seq_len=40")
    plain = sft(llama_dir, chat_file, tmp_path / "plain", *run, nproc=2)
    liger = sft(llama_dir, chat_file, tmp_path / "liger", *run, "model.liger=true", nproc=2)
    assert close(liger, plain, "loss") and close(liger, plain, "grad_norm")


def test_liger_on_cpu_is_refused_outside_the_triton_interpreter(llama_dir, chat_file, tmp_path):
    with pytest.raises(ModelError, match="model.liger=true needs a CUDA device .* TRITON_INTERPRET=1"):
        sft(llama_dir, chat_file, tmp_path / "run", "train.max_steps=1", "model.liger=true",
            env={"TRITON_INTERPRET": "0"})


def test_two_nodes_save_on_sigusr1_exit_zero_and_resume(llama_dir, chat_file, tmp_path, reference):
    """Two `finetune sft --nnodes 2 --nproc-per-node 1` launchers meet at a c10d endpoint on 127.0.0.1, as
    examples/slurm/ starts one per node. Both ranks pause at step 3 (fault pause_at_step) until SLURM's pre-timeout
    SIGUSR1 reaches their launcher, which forwards it: one checkpoint (step 3), both launchers exit 0. The
    resubmitted run (here in-process, the same 2 ranks) resumes and ends as the uninterrupted run."""
    out, two_ranks = tmp_path / "run", ("train.max_steps=8", "train.micro_batch_size=2")
    args = ["sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", out, "--nnodes", 2,
            "--nproc-per-node", 1, "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *BASE, *two_ranks]
    nodes = [cli_process(*args, env={"FINETUNE_TEST_FAULTS": "pause_at_step=3"}, start_new_session=True)
             for _ in range(2)]
    try:
        for node in nodes:
            seen = []
            while not any("paused at step 3" in line for line in seen) and (line := node.stderr.readline()):
                seen.append(line)
            assert "paused at step 3" in "".join(seen), "".join(seen)
        for node in nodes:
            node.send_signal(signal.SIGUSR1)
        results = [node.communicate(timeout=180) for node in nodes]
    finally:  # a failed test leaves no paused ranks behind
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in results]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3"]
    assert sum(f"received SIGUSR1: saved checkpoint {out / 'checkpoints' / 'step-3'}" in o for o, _ in results) == 1
    assert all("SIGUSR1 forwarded to the ranks; they saved and stopped" in err for _, err in results)
    sft(llama_dir, chat_file, out, *two_ranks, nproc=2)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    assert losses(out) == losses(reference(llama_dir, chat_file, *two_ranks, nproc=2))
