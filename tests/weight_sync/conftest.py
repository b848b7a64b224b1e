"""Fixtures shared by the broadcast tests (test_broadcast_*.py): the four processes of
`broadcast_phases.worker` run once per session, whichever of those files asked first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from procs import free_port, spawn

from tests.weight_sync.broadcast_phases import NUM_PORTS, worker
from tests.weight_sync.ep_phase import GATHERED, RECEIVED
from tests.weight_sync.tp_phase import KINDS, SYNCS


@pytest.fixture(scope="session")
def broadcast_results(tmp_path_factory) -> list[dict]:
    """What sync ranks 0, 1 (training) and 2 (rollout) of phases 1-3 wrote."""
    folder = tmp_path_factory.mktemp("broadcast")
    ports = tuple(free_port() for _ in range(NUM_PORTS))
    spawn(worker, args=(ports, str(folder)), nprocs=4, join=True)
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(3)]


@pytest.fixture(scope="session")
def ep_results(broadcast_results) -> dict:
    """The expert-parallel phase: what each rank wrote."""
    folder = Path(broadcast_results[0]["folder"])
    return {
        "senders": [json.loads((folder / f"ep_rank{r}.json").read_text()) for r in (0, 1)],
        "full": torch.load(folder / "ep_full.pt"),
        "received": {k: torch.load(folder / f"ep_{k}.pt") for k in RECEIVED},
        "gathered": {k: torch.load(folder / f"ep_{k}.pt") for k in GATHERED},
    }


@pytest.fixture(scope="session")
def tp_results(broadcast_results) -> dict:
    """The tensor-parallel phase, per model kind: what each sender wrote (`senders`), each sender's
    owner-only and full exports (`exports`), what each rollout rank received per sync (`received`);
    and `fsdp_tp`, `pp_tp`: each of the 4 ranks' check of its FSDP x TP and PP x TP exports."""
    folder = Path(broadcast_results[0]["folder"])
    senders = [json.loads((folder / f"tp_rank{r}.json").read_text()) for r in (0, 1)]
    four = [json.loads((folder / f"tp_rank{r}.json").read_text()) for r in range(4)]
    return {"fsdp_tp": [r["fsdp_tp"] for r in four], "pp_tp": [r["pp_tp"] for r in four]} | {
        kind: {
            "senders": [s[kind] for s in senders],
            "exports": [torch.load(folder / f"tp_{kind}_export_{r}.pt") for r in (0, 1)],
            "received": {
                f"{sync}_{r}": torch.load(folder / f"tp_{kind}_{sync}_{r}.pt")
                for sync in SYNCS
                for r in (2, 3)
            },
        }
        for kind in KINDS
    }
