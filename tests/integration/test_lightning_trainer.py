"""Lightning ``Trainer`` with ``FSDPStrategy``, torch's FSDP1 class switched to fsdp_compat's.

The switch is the public ``fsdp_compat.torch_patched()``; see ``test_lightning_fabric.py`` for what it
rebinds. CPU shim: a subclass of ``FSDPStrategy`` with no changes (the connector refuses exactly
``FSDPStrategy`` without a GPU). torch's FSDP1 cannot run this flow on CPU (Lightning passes
``device_id=None`` there), so the oracle is the uninterrupted run and the unsharded model.
"""

from __future__ import annotations

import glob
import os

import pytest

pytest.importorskip("lightning", reason="needs the integration extra: pip install -e '.[integration]'")

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from fsdp_compat.testing import distributed_test

from ._common import assert_close, full_state, run_flow, shared_tmpdir

MAX_STEPS, ACCUMULATE, BATCH = 4, 2, 4


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy unchanged: only ``type(...) is FSDPStrategy`` (the GPU check) differs."""


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    # Two epochs of MAX_STEPS // 2 optimizer steps: checkpoints at the epoch boundary, where a plain
    # DataLoader resumes exactly (mid-epoch, Lightning restarts the epoch's data).
    n = 2 * BATCH * ACCUMULATE * (MAX_STEPS // 2)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)),
                      batch_size=BATCH)


def _trainer(directory: str, state_dict_type: str, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=2,
        strategy=CPUFSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type=state_dict_type),
        max_steps=MAX_STEPS, accumulate_grad_batches=ACCUMULATE,
        default_root_dir=directory, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, **kwargs)


def _fit_and_resume(state_dict_type: str, directory: str):
    # Saved after the epoch's last optimizer step (on_train_batch_end). Not every_n_epochs=1: Lightning
    # 2.6 resumes a checkpoint saved at on_train_epoch_end with one more batch in the finished epoch (a
    # fresh iterator's first batch, stepped with half an accumulation) and the next epoch reshuffled:
    # Lightning's loop, not the strategy: plain DDP ends the same 1.9e-2 away, and under fsdp_compat
    # model and optimizer state were measured loaded exactly on every rank.
    checkpoints = ModelCheckpoint(dirpath=os.path.join(directory, "ckpt"), every_n_train_steps=MAX_STEPS // 2,
                                  save_top_k=-1, save_last=False)
    trainer = _trainer(directory, state_dict_type, callbacks=[checkpoints], limit_val_batches=0)
    model = Regressor()
    trainer.fit(model, _data())
    uninterrupted = full_state(trainer.strategy.model)
    first = sorted(glob.glob(os.path.join(directory, "ckpt", "*step=2*")))
    assert first, os.listdir(os.path.join(directory, "ckpt"))

    resumed_trainer = _trainer(directory, state_dict_type, limit_val_batches=0, enable_checkpointing=False)
    resumed_trainer.fit(Regressor(), _data(), ckpt_path=first[0])
    return uninterrupted, full_state(resumed_trainer.strategy.model), resumed_trainer.global_step


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
@distributed_test(world_size=2)
def test_trainer_fit_resumes_from_checkpoint_like_uninterrupted(state_dict_type):
    with shared_tmpdir() as directory:
        uninterrupted, resumed, step = run_flow(_fit_and_resume, state_dict_type, directory, ours=True)
    assert step == MAX_STEPS
    initial = Regressor().state_dict()
    assert any(not torch.equal(uninterrupted[k], initial[k]) for k in initial), "the model did not train"
    assert_close(resumed, uninterrupted, atol=1e-6)


def _evaluate(directory: str):
    trainer = _trainer(directory, "full", enable_checkpointing=False)
    model = Regressor()
    trainer.fit(model, _data(), _data())  # validation runs during fit too
    state = full_state(trainer.strategy.model)
    metrics = (trainer.validate(model, _data(), verbose=False), trainer.test(model, _data(), verbose=False))
    predictions = trainer.predict(model, _data())
    return state, metrics, torch.cat(predictions)


@distributed_test(world_size=2)
def test_trainer_validate_test_predict_use_the_trained_model():
    with shared_tmpdir() as directory:
        state, (validated, tested), predictions = run_flow(_evaluate, directory, ours=True)
    plain = Regressor()
    plain.load_state_dict(state, strict=True)
    x, y = _data().dataset.tensors
    with torch.no_grad():
        expected = nn.functional.mse_loss(plain(x), y).item()
    assert_close(validated[0]["val_loss"], expected, atol=1e-5)
    assert_close(tested[0]["test_loss"], expected, atol=1e-5)
    rank, per_rank = torch.distributed.get_rank(), len(x) // 2
    # Lightning's DistributedSampler gives rank r the samples r, r+2, r+4, ...
    with torch.no_grad():
        assert_close(predictions, plain(x[rank::2]), atol=1e-5)
    assert len(predictions) == per_rank
