"""smp.save_checkpoint / smp.resume_from_checkpoint: resuming continues training exactly,
rotation, the newest pointer, full checkpoints and their translation, Hugging Face weights,
a resume before the model exists, a crash at every step of the commit and a SIGKILL while
writing, and the same on 2 real pipeline ranks."""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import smp_fx as smp
from smp_fx.ckpt import checkpoint_api
from tests.helpers.ckpt import kill_mid_save
from tests.helpers.dist import run_ranks
from tests.helpers.models import example
from tests.helpers.numerics import init


@pytest.fixture(autouse=True)
def _fresh(one_thread: None) -> None:
    init(2, 2, "interleaved")


class Run:
    """The gpt example (tied embedding) as a DistributedModel with Adam, one step at a time;
    batches are a function of the step, so two runs can be compared step for step."""

    def __init__(self, seed: int, name: str = "gpt",
                 place: Callable[[torch.nn.Module], None] | None = None,
                 **opt_args: Any) -> None:
        self.ex = example(name)
        torch.manual_seed(seed)
        module = self.ex.build_model()
        if place is not None:  # a manual cut (``auto_partition: False``)
            place(module)
        self.model = smp.DistributedModel(module)
        self.opt = smp.DistributedOptimizer(torch.optim.Adam(self.model.parameters(), lr=0.01),
                                            **opt_args)
        ex = self.ex

        @smp.step
        def train(model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
            loss = ex.loss_fn(model(x), y)
            model.backward(loss)
            return loss

        self._train = train

    def step(self, n: int) -> float:
        torch.manual_seed(1000 + n)
        x, y = self.ex.example_inputs(4)[0], self.ex.example_targets(4)
        self.opt.zero_grad()
        loss = self._train(self.model, x, y).reduce_mean().item()
        self.opt.step()
        return loss

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.local_named_parameters()}


def _assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_resume_continues_exactly_with_rotation_and_newest(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    run = Run(seed=0)
    for n in (1, 2, 3):
        run.step(n)
        smp.save_checkpoint(path, f"step{n}", model=run.model, optimizer=run.opt,
                            user_content={"step": n, "rng": torch.get_rng_state()},
                            num_kept_partial_checkpoints=2)
    assert checkpoint_api.read_newest(path) == ["step2_partial", "step3_partial"]
    assert sorted(os.listdir(path)) == ["newest", "step2_partial", "step3_partial"]
    assert {"model.pt_0", "optimizer.pt_0", "user_content.pt", "smp_config.json"} <= set(
        os.listdir(os.path.join(path, "step3_partial")))
    want_loss, want = run.step(4), run.params()

    smp.reset()
    resumed = Run(seed=1)  # other initial weights: everything must come from the checkpoint
    user = smp.resume_from_checkpoint(path)  # the newest: step3
    assert user["step"] == 3
    assert resumed.step(4) == want_loss
    _assert_same_params(resumed.params(), want)

    smp.reset()
    older = Run(seed=2)
    assert smp.resume_from_checkpoint(path, tag="step2")["step"] == 2
    older.step(3)
    assert older.step(4) == want_loss


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_half_precision_run_resumes_exactly(tmp_path: Path, precision: str) -> None:
    """The fp32 masters, Adam's state and, in fp16, the loss scale come back: the resumed
    steps equal the uninterrupted ones bitwise (fp16 starts at a scale that overflows)."""
    init(2, 2, "interleaved", **{precision: True})
    scale = {"dynamic_loss_scale": True, "dynamic_loss_args": {
        "init_scale": 2.0**24, "scale_factor": 2.0**8}} if precision == "fp16" else {}
    path = str(tmp_path / "ck")
    run = Run(seed=0, **scale)
    skipped = []
    for n in (1, 2, 3):
        run.step(n)
        skipped.append(run.opt.overflow)
    assert skipped == [precision == "fp16", False, False]
    smp.save_checkpoint(path, "s3", model=run.model, optimizer=run.opt)
    want = [run.step(4), run.step(5)]
    want_params = run.params()

    smp.reset()
    resumed = Run(seed=1, **scale)
    smp.resume_from_checkpoint(path)
    assert [resumed.step(4), resumed.step(5)] == want and not resumed.opt.overflow
    _assert_same_params(resumed.params(), want_params)
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    assert all(p.dtype == half for p in resumed.params().values())


def test_resume_before_the_model_exists_applies_at_creation(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    run = Run(seed=0)
    run.step(1)
    smp.save_checkpoint(path, "a", model=run.model, optimizer=run.opt)
    want_loss = run.step(2)
    smp.reset()
    assert smp.resume_from_checkpoint(path, tag="a") is None  # no user_content saved
    late = Run(seed=5)
    assert late.step(2) == want_loss


class _Script:
    """An object of a script's own, which no allowlist covers."""


def test_user_content_of_the_scripts_own_objects(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS's GPT-2 example saves its argument dict, its scheduler's state and its
    GPT2Config: they load safely. Another class needs the explicit trust switch."""
    import argparse

    from transformers import GPT2Config

    path = str(tmp_path / "ck")
    run = Run(seed=0)
    run.step(1)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    args = argparse.Namespace(lr=1e-3, seed=3)
    smp.save_checkpoint(path, "a", model=run.model, optimizer=run.opt, user_content={
        "cli_args": vars(args), "args": args, "model_config": config,
        "lr_scheduler": {"num_iters": 1, "decay_style": "linear"}, "total_steps": 1})
    user = smp.resume_from_checkpoint(path)
    assert isinstance(user["model_config"], GPT2Config)
    assert user["model_config"].to_dict() == config.to_dict()
    assert user["args"] == args and user["cli_args"] == vars(args)
    assert user["lr_scheduler"]["num_iters"] == 1
    smp.save_checkpoint(path, "b", model=run.model, optimizer=run.opt,
                        user_content={"mine": _Script()})
    with pytest.raises(smp.SMPCheckpointError, match="SMP_FX_TRUST_CHECKPOINTS"):
        smp.resume_from_checkpoint(path, tag="b")
    monkeypatch.setenv("SMP_FX_TRUST_CHECKPOINTS", "1")
    assert isinstance(smp.resume_from_checkpoint(path, tag="b")["mine"], _Script)


def test_full_checkpoint_translation_and_hugging_face_weights(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = str(tmp_path / "full")
    run = Run(seed=0)
    run.step(1)
    after1 = run.params()
    plain = {k: v.clone() for k, v in run.model.state_dict().items()}

    def translators() -> None:  # hf_to_smp breaks names it was not made for
        smp.state.module_manager.register_translate_function(
            (lambda sd: {f"hf.{k}": v for k, v in sd.items()},
             lambda sd: {k[len("hf."):]: v for k, v in sd.items()}))

    translators()
    smp.save_checkpoint(path, "model.pt", partial=False, model=run.model,
                        optimizer=run.opt, user_content={"note": "full"})
    on_disk = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    assert list(on_disk) == [f"hf.{k}" for k in plain]  # a plain torch file, translated
    smp.save_checkpoint(path, "raw.pt", partial=False, model=run.model,
                        translate_if_full=False)
    raw = torch.load(os.path.join(path, "raw.pt"), weights_only=True)
    assert raw.pop("_smp_is_partial") is False and list(raw) == list(plain)
    for tag, user in (("model.pt", {"note": "full"}), ("raw.pt", None)):
        smp.reset()  # forgets the translators too
        translators()
        again = Run(seed=3)
        assert smp.resume_from_checkpoint(path, tag=tag, partial=False) == user
        _assert_loaded(again, after1)
    # save_pretrained's folder (tied copy left out): what the Hugging Face Trainer's resume
    # asks for as pytorch_model.bin
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({k: v.contiguous() for k, v in plain.items() if k != "lm_head.weight"},
              str(hf / "model.safetensors"))
    smp.reset()
    from_hf = Run(seed=4)
    smp.resume_from_checkpoint(str(hf), tag="pytorch_model.bin", partial=False,
                               load_optimizer=False)
    _assert_loaded(from_hf, after1)


def test_bad_arguments_are_errors(tmp_path: Path) -> None:
    run = Run(seed=0)
    path = str(tmp_path / "ck")
    with pytest.raises(smp.SMPCheckpointError, match="same non-empty file name"):
        smp.save_checkpoint(path, "a/b", model=run.model)
    with pytest.raises(smp.SMPCheckpointError, match="num_kept_partial_checkpoints"):
        smp.save_checkpoint(path, "a", model=run.model, num_kept_partial_checkpoints=0)
    with pytest.raises(smp.SMPCheckpointError, match="needs the partitioned model"):
        smp.save_checkpoint(path, "a", model=run.model)  # not partitioned yet: no local state
    assert not os.path.exists(os.path.join(path, "a_partial"))
    with pytest.raises(smp.SMPCheckpointError, match="no partial checkpoint is listed"):
        smp.resume_from_checkpoint(path)
    with pytest.raises(smp.SMPCheckpointError, match="tag is required"):
        smp.resume_from_checkpoint(path, partial=False)
    run.step(1)
    smp.save_checkpoint(path, "m", model=run.model)  # no optimizer in it
    with pytest.raises(smp.SMPCheckpointError, match="holds no state for the Distributed"):
        smp.resume_from_checkpoint(path, tag="m")
    assert smp.resume_from_checkpoint(path, tag="m", load_optimizer=False) is None


class Crash(BaseException):
    """Stands for the process dying at that instant (no ``except Exception`` handles it)."""


@pytest.mark.parametrize("same_tag", [False, True], ids=["new-tag", "same-tag"])
def test_crash_at_every_step_of_a_save_leaves_a_whole_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same_tag: bool) -> None:
    """The save is cut at its k-th file operation (rename, delete), for every k until it
    completes. A resume then loads one whole checkpoint: the new one exactly when its
    commit point had passed (``newest`` rewritten for a new tag; the staging folder renamed
    into place when a tag is saved again), else the previous one."""
    template = str(tmp_path / "template")
    run = Run(seed=0, name="mlp")
    run.step(1)
    smp.save_checkpoint(template, "t", model=run.model, optimizer=run.opt,
                        user_content={"gen": 1})
    gens = {1: run.params()}
    run.step(2)
    gens[2] = run.params()
    k, done = 0, False
    while not done:
        k += 1
        path = str(tmp_path / f"k{k}")
        shutil.copytree(template, path)
        ops: list[tuple[str, tuple[Any, ...]]] = []
        with monkeypatch.context() as m:
            for mod, name in ((os, "replace"), (os, "unlink"), (shutil, "rmtree")):
                m.setattr(mod, name, _dying(getattr(mod, name), name, k, ops))
            try:
                smp.save_checkpoint(path, "t" if same_tag else "t2", model=run.model,
                                    optimizer=run.opt, user_content={"gen": 2})
                done = True
            except Crash:
                pass
        if same_tag:
            passed = any(n == "replace" and str(a[0]).endswith(".incomplete") for n, a in ops)
        else:
            passed = any(n == "replace" and str(a[1]).endswith("newest") for n, a in ops)
        smp.reset()
        resumed = Run(seed=9, name="mlp")
        gen = smp.resume_from_checkpoint(path)["gen"]
        assert gen == (2 if passed else 1), (k, ops)
        _assert_loaded(resumed, gens[gen])
    assert k > 8  # the save had that many steps to be cut at


def _dying(real: Any, name: str, at: int, ops: list[tuple[str, tuple[Any, ...]]]) -> Any:
    """``real``, except that the ``at``-th file operation of any kind raises ``Crash``."""
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if len(ops) + 1 == at:
            raise Crash(name)
        out = real(*args, **kwargs)
        ops.append((name, args))
        return out
    return wrapped


def _assert_loaded(run: Run, want: dict[str, torch.Tensor]) -> None:
    """The deferred load is applied at partitioning: run a forward-only step, compare."""
    @smp.step
    def fwd(model: Any, x: torch.Tensor) -> Any:
        return model(x)

    with torch.no_grad():
        fwd(run.model, *run.ex.example_inputs(2))
    got = run.params()
    _assert_same_params(got, {n: want[n] for n in got})


SLOW_SAVE = textwrap.dedent("""
    import sys, time, torch
    import smp_fx as smp
    from tests.helpers.models import example

    class Slow:
        def __reduce__(self):
            time.sleep(60)
            return (int, (0,))

    path = sys.argv[1]
    smp.init({"pipeline_parallel_degree": 2, "microbatches": 2})
    ex = example("gpt")
    torch.manual_seed(0)
    model = smp.DistributedModel(ex.build_model())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    @smp.step
    def train(model, x, y):
        loss = ex.loss_fn(model(x), y)
        model.backward(loss)
        return loss

    train(model, ex.example_inputs(4)[0], ex.example_targets(4))
    opt.step()
    smp.save_checkpoint(path, "a", model=model, optimizer=opt, user_content={"gen": 1})
    torch.save(model.state_dict(), path + ".gen1.pt")
    train(model, ex.example_inputs(4)[0], ex.example_targets(4))
    opt.step()
    smp.save_checkpoint(path, "b", model=model, optimizer=opt,
                        user_content={"gen": 2, "slow": Slow()})
""")


@pytest.mark.multiproc
def test_sigkill_during_save_checkpoint_leaves_previous_loadable(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    staging = os.path.join(path, ".b_partial.incomplete")
    kill_mid_save(SLOW_SAVE, [path], lambda: os.path.isdir(staging) and any(
        n.endswith(".tmp") for n in os.listdir(staging)), tmp_path)
    assert checkpoint_api.read_newest(path) == ["a_partial"]
    resumed = Run(seed=7)
    assert smp.resume_from_checkpoint(path)["gen"] == 1
    want = torch.load(path + ".gen1.pt", weights_only=True)
    _assert_loaded(resumed, want)


def _two_rank_body(path: str) -> dict[str, Any]:
    """pp=2 on 2 processes: save twice (keep one), resume into a fresh model, continue."""
    init(2, 2, "interleaved")
    run = Run(seed=0)
    for n in (1, 2):
        run.step(n)
        smp.save_checkpoint(path, f"s{n}", model=run.model, optimizer=run.opt,
                            user_content={"step": n}, num_kept_partial_checkpoints=1)
    full = run.model.state_dict(gather_to_rank0=True)
    want_loss, want = run.step(3), run.params()
    smp.reset()
    resumed = Run(seed=1)
    user = smp.resume_from_checkpoint(path)
    got_loss = resumed.step(3)
    mismatched = [n for n, p in resumed.params().items() if not torch.equal(p, want[n])]
    return {"user": user, "losses": (want_loss, got_loss), "mismatched": mismatched,
            "full_keys": len(full), "newest": checkpoint_api.read_newest(path),
            "files": sorted(os.listdir(os.path.join(path, "s2_partial")))}


@pytest.mark.multiproc
def test_two_pipeline_ranks_save_and_resume(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_two_rank_body, 2, str(tmp_path / "ck"), timeout=240)
    for r in (r0, r1):
        assert r["user"] == {"step": 2} and r["newest"] == ["s2_partial"]
        assert r["losses"][0] == r["losses"][1] and r["mismatched"] == []
    assert r0["full_keys"] == len(example("gpt").build_model().state_dict())
    assert r1["full_keys"] == 0  # gather_to_rank0: only pipeline rank 0 holds it
    assert {"model.pt_0", "model.pt_1", "optimizer.pt_0", "optimizer.pt_1"} <= set(r0["files"])
    assert not os.path.exists(tmp_path / "ck" / "s1_partial")


def _first_block_on(stage: int) -> Callable[[torch.nn.Module], None]:
    """A cut of the 2-block gpt example: the embeddings on stage 0, the first block on
    ``stage``, the rest on stage 1."""
    def place(module: Any) -> None:
        smp.set_partition(module.h[0], stage)
        for part in (module.h[1], module.ln_f, module.lm_head):
            smp.set_partition(part, 1)
    return place


def _another_cut_body(path: str) -> dict[str, Any]:
    """pp=2 on 2 processes, Adam: save with the first block on stage 0, resume into a model
    cut with it on stage 1 (the same degrees, another partition: what an automatic cut
    measured on another run gives), take the same step. The world is joined once, so each
    ``smp.init`` only builds its groups."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    init(2, 2, "interleaved", auto_partition=False, default_partition=0)
    run = Run(seed=0, place=_first_block_on(0))
    run.step(1)
    smp.save_checkpoint(path, "s1", model=run.model, optimizer=run.opt)
    want_loss = run.step(2)
    want = run.model.state_dict()
    smp.reset()
    init(2, 2, "interleaved", auto_partition=False, default_partition=0)
    resumed = Run(seed=1, place=_first_block_on(1))
    smp.resume_from_checkpoint(path, "s1")
    got_loss = resumed.step(2)
    got = resumed.model.state_dict()
    held = [sorted(n for n, _ in r.model.local_named_parameters()) for r in (run, resumed)]
    return {"losses": (want_loss, got_loss), "moved": held[0] != held[1],
            "mismatched": [n for n in want if not torch.equal(want[n], got[n])]}


@pytest.mark.multiproc
def test_a_checkpoint_resumes_on_another_cut_at_the_same_degrees(tmp_path: Path) -> None:
    for r in run_ranks(_another_cut_body, 2, str(tmp_path / "ck"), timeout=240):
        assert r["moved"], "the two cuts must put a block on different stages"
        assert r["losses"][0] == r["losses"][1] and r["mismatched"] == []
