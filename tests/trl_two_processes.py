"""Run under torchrun with 2 processes (tests/test_trl.py): GRPOTrainer with TLTRollout and an
EAGLE drafter; process 1's rollouts are held back a moment so that process 0 idles and trains
the drafter. Writes each process's report (drafter checksum, metrics) as JSON to argv[1]."""

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_trl import _trainer  # noqa: E402

from tailtamer.integrations.trl import TLTRollout  # noqa: E402
from tailtamer.model.drafter import weights_checksum  # noqa: E402
from tailtamer.rollout.engine import Engine  # noqa: E402


def main(model_dir: str, drafter_dir: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    rollout = TLTRollout(spec="on", drafter=drafter_dir, strategy="3_1_4")
    if rank == 1:  # the slower process: its rollout ends later
        real = Engine.generate

        def slow(self, *args, **kwargs):
            result = real(self, *args, **kwargs)
            time.sleep(1.5)
            return result
        Engine.generate = slow
    trainer, _ = _trainer(Path(model_dir), Path(out).parent / f"rank{rank}", rollout, steps=2)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "tlt/drafter_steps" in r]
    Path(f"{out}.{rank}").write_text(json.dumps({
        "checksum": weights_checksum(rollout.adaptive.drafter), "rows": rows, "calls": rollout.calls}))
    # What this checks is written. PyTorch's teardown of the gloo group is left out: at the
    # interpreter's exit it aborted once in about 20 runs ("terminate called without an active
    # exception"), and destroy_process_group (trainer.end()) hung once in about 4.
    os._exit(0)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:4])
