"""A tensor-parallel rank other than 0: ``python -P -m modeserve.engine.distributed.worker SPEC``
(SPEC: the JSON ``TpWorkers`` writes). It builds its share of the engine's model runner, then runs
every batch rank 0 sends, by the method rank 0 ran, until rank 0 sends None."""

from __future__ import annotations

import json
import logging
import sys

import torch

from ..runner.build import build_runner
from ..config import EngineConfig
from ..models.loader import open_checkpoint
from .group import TpGroup, tp_store

logger = logging.getLogger(__name__)


def serve_rank(spec: dict) -> None:
    config = EngineConfig.from_kwargs(model=spec["model"], **spec["kwargs"])
    rank, size = spec["rank"], config.runner.tensor_parallel_size
    device = torch.device(config.runner.device, rank) if config.runner.device == "cuda" else torch.device("cpu")
    tp = TpGroup(rank, tp_store(rank, size, spec["host"], spec["port"]), size, device)
    runner = build_runner(config, open_checkpoint(spec["model"], config.runner.load_format), None, tp)
    while (step := tp.recv_step()) is not None:
        method, batch = step
        try:
            getattr(runner, method)(batch)
        except ValueError:  # rank 0 raised it too, on the same batch, and answers for the engine
            logger.debug("rank %d: batch refused", rank, exc_info=True)


if __name__ == "__main__":
    serve_rank(json.loads(sys.argv[1]))
