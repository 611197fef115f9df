"""The OpenAI-compatible HTTP API through the official ``openai`` client, against real ``modeserve
serve`` and ``modeserve router`` + ``modeserve engine`` processes on a tiny model with a real
tokenizer: outputs equal ``LLM.generate``'s (greedy), usage, stop strings, logprobs equal the gRPC
API's, 64 concurrent streams, and bad input answered with OpenAI's error JSON."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

from modeserve.service.rpc.client import GenerateClient
from modeserve.service.rpc.engine_process import read_address, stop_process
from tests.service.http_fixtures import CHAT, call, greedy_reference, http_process, tiny_model_with_tokenizer

pytestmark = pytest.mark.slow
MAX_NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-http"))


@contextlib.contextmanager
def router_over_engine(model: Path) -> Iterator[tuple[str, str]]:
    import subprocess
    import sys

    engine = subprocess.Popen([sys.executable, "-m", "modeserve.service.cli", "engine", "--model", str(model), "--host",
                               "127.0.0.1", "--port", "0", "--page-size", "4", "--kv-cache-tokens", "8192",
                               "--grace-period", "5"], stdout=subprocess.PIPE, text=True)
    try:
        address = read_address(engine, "engine", 300)
        with http_process("router", "--engines", address, "--model", str(model), "--chunked-prefill-size", "32",
                          "--enable-mixed") as addrs:
            yield addrs
    finally:
        stop_process(engine)


@pytest.fixture(scope="module", params=["serve", "router"])
def server(request: pytest.FixtureRequest, model: Path) -> Iterator[tuple[str, str]]:
    if request.param == "serve":
        cm = http_process("serve", "--model", str(model), "--page-size", "4", "--kv-cache-tokens", "8192",
                          "--chunked-prefill-size", "32", "--enable-mixed")
    else:
        cm = router_over_engine(model)
    with cm as addrs:
        yield addrs


@pytest.fixture(scope="module")
def client(server: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0)


def chat_ids(base: str, messages: list[dict[str, str]]) -> list[int]:
    status, body = call(base, "/tokenize", {"messages": messages})
    assert status == 200, body
    return list(body["tokens"])


def model_name(client: openai.OpenAI) -> str:
    (m,) = client.models.list().data
    return m.id


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    (m,) = client.models.list().data
    assert m.id and m.owned_by == "modeserve"


def test_chat_equals_llm_generate_whole_and_streamed(server: tuple[str, str], client: openai.OpenAI,
                                                     model: Path) -> None:
    ids = chat_ids(server[1], CHAT)
    ((ref_ids, ref_text, ref_finish),) = greedy_reference(model, [ids], MAX_NEW)
    name = model_name(client)
    whole = client.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_NEW, temperature=0)  # type: ignore[arg-type]
    (choice,) = whole.choices
    assert choice.message.content == ref_text and choice.message.role == "assistant"
    assert choice.finish_reason == ref_finish
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(ref_ids))
    assert whole.usage.total_tokens == len(ids) + len(ref_ids)

    chunks = list(client.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_NEW, temperature=0,  # type: ignore[call-overload]
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [ref_finish]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_prompts_equal_llm_generate(server: tuple[str, str], client: openai.OpenAI,
                                                               model: Path) -> None:
    status, tok = call(server[1], "/tokenize", {"prompt": "The quick brown fox"})
    assert status == 200
    prompts: list[list[int]] = [tok["tokens"], [5, 6, 7, 8, 9], [100, 2000, 30000]]
    ref = greedy_reference(model, prompts, MAX_NEW, ignore_eos=True)
    extra = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(model=model_name(client), prompt=prompts, max_tokens=MAX_NEW, temperature=0,
                                      extra_body=extra)
    (text_choice,) = client.completions.create(model=model_name(client), prompt="The quick brown fox",
                                               max_tokens=MAX_NEW, temperature=0, extra_body=extra).choices
    assert (text_choice.model_extra["token_ids"], text_choice.text) == ref[0][:2]  # type: ignore[index]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    for c, (ids, text, _) in zip(whole.choices, ref):
        assert (c.text, c.model_extra["token_ids"], c.finish_reason) == (text, ids, "length")  # type: ignore[index]
    assert whole.usage is not None and whole.usage.completion_tokens == 3 * MAX_NEW
    assert whole.usage.prompt_tokens == sum(len(p) for p in prompts)

    texts = ["", "", ""]
    for chunk in client.completions.create(model=model_name(client), prompt=prompts, max_tokens=MAX_NEW,  # type: ignore[call-overload]
                                           temperature=0, stream=True, extra_body=extra):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [text for _, text, _ in ref]


def test_echo_returns_the_prompt_first(client: openai.OpenAI) -> None:
    out = client.completions.create(model=model_name(client), prompt="Once upon a time", max_tokens=4, temperature=0,
                                    echo=True)
    assert out.choices[0].text.startswith("Once upon a time") and len(out.choices[0].text) > len("Once upon a time")


def test_stop_string_cuts_the_text(client: openai.OpenAI, model: Path) -> None:
    ((_, ref_text, _),) = greedy_reference(model, [[5, 6, 7, 8, 9]], 24, ignore_eos=True)
    stop = ref_text[len(ref_text) // 2: len(ref_text) // 2 + 3]
    assert stop.strip()
    cut = ref_text[: ref_text.index(stop)]
    for stream in (False, True):
        got = client.completions.create(model=model_name(client), prompt=[5, 6, 7, 8, 9], max_tokens=24,  # type: ignore[call-overload]
                                        temperature=0, stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_logprobs_equal_the_grpc_apis(server: tuple[str, str], client: openai.OpenAI) -> None:
    grpc_client = GenerateClient(server[0])
    try:
        msgs = list(grpc_client.stream(token_ids=[5, 6, 7], max_new_tokens=6, ignore_eos=True, logprobs=3))
    finally:
        grpc_client.close()
    grpc_ids = [t for m in msgs for t in m.token_ids]
    grpc_lp = [lp for m in msgs for lp in m.logprobs]
    grpc_top = [list(zip(t.token_ids, t.logprobs)) for m in msgs for t in m.top_logprobs]
    out = client.completions.create(model=model_name(client), prompt=[5, 6, 7], max_tokens=6, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert out.choices[0].model_extra["token_ids"] == grpc_ids  # type: ignore[index]
    assert lp.token_logprobs == pytest.approx(grpc_lp, abs=1e-6)
    assert [len(t) for t in lp.top_logprobs] == [3] * 6 and len(grpc_top) == 6
    assert [sorted(t.values(), reverse=True) for t in lp.top_logprobs] == [
        pytest.approx([v for _, v in alts], abs=1e-6) for alts in grpc_top]

    chat = client.chat.completions.create(model=model_name(client), messages=CHAT, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy: the top one


def test_64_concurrent_streams_all_complete(server: tuple[str, str], model: Path, client: openai.OpenAI) -> None:
    prompts = [[3 + (i * 37 + j * 11) % 4000 for j in range(2 + i % 9)] for i in range(64)]
    ref = greedy_reference(model, prompts, MAX_NEW, ignore_eos=True)
    name = model_name(client)

    async def one(aclient: openai.AsyncOpenAI, prompt: list[int]) -> list[int]:
        ids: list[int] = []
        stream = await aclient.completions.create(model=name, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            for c in chunk.choices:
                ids += c.model_extra["token_ids"]  # type: ignore[index]
        return ids

    async def run_all() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(run_all()) == [ids for ids, _, _ in ref]


MESSAGES = [{"role": "user", "content": "hi"}]
BAD: list[tuple[str, dict[str, Any] | bytes, int, str | None]] = [
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", b'{"messages": [', 400, None),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 5}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 4, "stop_token_ids": [10**7]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": " ".join(map(str, range(300)))}, 400, "prompt"),  # over the 256-token context
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + b"a" * (10 * 2**20) + b'"}]}', 413, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_error_json_and_serving_goes_on(server: tuple[str, str], path: str,
                                                              body: dict[str, Any] | bytes, status: int,
                                                              param: str | None) -> None:
    got, err = call(server[1], path, raw=body) if isinstance(body, bytes) else call(server[1], path, body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param
    if param is not None:
        assert param in err["error"]["message"]
    ok, out = call(server[1], "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
    assert ok == 200 and out["usage"]["completion_tokens"] <= 2


def test_openai_client_raises_its_own_error_types(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_name(client), messages=MESSAGES, temperature=-1)  # type: ignore[arg-type]
    assert bad.value.param == "temperature"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)  # type: ignore[arg-type]
