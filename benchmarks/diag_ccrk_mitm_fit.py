"""When does CCRk's MITM loss fit one fixed world batch through the real training step? Prints the
first fixed step below 0.5 / 0.3 / 0.2 / 0.1 and the loss curve, for the bound that
``tests/test_itm_fits_a_world_batch.py`` states (docs/ccrk.md, "MITM through the real training step").

    PYTHONPATH=tests python benchmarks/diag_ccrk_mitm_fit.py --backbones small --seed 1 --root /tmp/itm

``--backbones small`` uses ``worlds.SMALL_PRETRAINED_BACKBONES`` (the test's), ``quick`` the 8-step
``QUICK_BACKBONES`` tower; ``--seed`` seeds the model's initialisation (the test uses 0).
"""

from __future__ import annotations

import argparse
import json

import test_itm_fits_a_world_batch as fit_test
import torch
from worlds import SMALL_PRETRAINED_BACKBONES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backbones", choices=["small", "quick"], default="small")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", required=True, help="folder for the small world (reused)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    backbones = SMALL_PRETRAINED_BACKBONES if args.backbones == "small" else []
    losses = fit_test.ccrk_matching_losses(args.root, backbones, args.steps, seed=args.seed)
    first = {
        str(bar): next((i + 1 for i, x in enumerate(losses) if x < bar), None)
        for bar in (0.5, 0.3, 0.2, 0.1)
    }
    print(
        json.dumps(
            {
                "first_step_below": first,
                "min": round(min(losses), 4),
                "losses": [round(x, 4) for x in losses],
            }
        )
    )


if __name__ == "__main__":
    main()
