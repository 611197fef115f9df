"""The operator's kmock tests' fixture: ``harness`` runs the operator (kopf in its own thread and
event loop) against kmock's emulator and a ``FakeRouter`` (``tests.operator.kmock_harness``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest_asyncio

from modeserve.operator.handlers import create_registry, operator_settings
from modeserve.operator.kube import Kube
from modeserve.operator.reconcile import EngineSetReconciler, OperatorConfig
from tests.operator.kmock_harness import NS, RESOURCES, FakeRouter, Harness


@pytest_asyncio.fixture
async def harness(kmock: Any) -> AsyncIterator[Harness]:
    for resource, kind in RESOURCES.items():
        kmock.resources[resource] = kmock.ResourceInfo(
            kind=kind, namespaced=kind != "Namespace", verbs={"get", "list", "watch", "create", "patch", "delete"},
            subresources={"status", "scale"} if kind == "EngineSet" else set())
    kmock.objects["v1/namespaces", None, NS] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    url = str(kmock.url).rstrip("/")
    config = OperatorConfig(namespaces=(NS,), reconcile_interval=0.2, default_image="modeserve:test",
                            router_retry_delay=0.2, router_service_account="modeserve-router")
    router = FakeRouter(kmock)
    registry = create_registry(EngineSetReconciler(config, Kube.for_server(url), router),
                               login=lambda **_: kopf.ConnectionInfo(server=url))
    stop = threading.Event()
    thread = threading.Thread(target=asyncio.run, name="kopf", args=(kopf.operator(
        registry=registry, settings=operator_settings(), standalone=True, clusterwide=False,
        namespaces=[NS], stop_flag=stop),))
    thread.start()
    try:
        yield Harness(kmock, router)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive()
