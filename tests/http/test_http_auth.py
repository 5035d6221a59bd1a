"""API keys and tenant cache isolation on the HTTP gateway.

A second gateway with API keys runs in this process, in front of the session server's
router (the keyless session gateway stays as it is), and is reached with the official
``openai`` client and with httpx. Cache isolation is read off
``usage.prompt_tokens_details.cached_tokens`` on the tiny Llama (4-token pages).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from radixserve.serving.http.auth import APIKeyAuth, KeyRing, bearer_token, tenant_cache_salt
from radixserve.serving.http.gateway import GatewayConfig
from radixserve.serving.http.server import HTTPGateway

KEY_A, KEY_B, ADMIN = "sk-tenant-a-0123456789", "sk-tenant-b-9876543210", "sk-admin-secret"


# ---------------------------------------------------------------------------- units (no server)


def test_key_ring_matches_exactly() -> None:
    ring = KeyRing([KEY_A, KEY_B])
    assert ring.match(KEY_A) == KEY_A and ring.match(KEY_B) == KEY_B
    for wrong in ("", KEY_A[:-1], KEY_A + "x", KEY_A.upper(), "sk-tenant-a"):
        assert ring.match(wrong) is None
    assert not KeyRing([]) and not KeyRing([""])


def test_bearer_header_parsing() -> None:
    assert bearer_token([(b"authorization", b"Bearer abc")]) == "abc"
    assert bearer_token([(b"Authorization", b"bearer  abc ")]) == "abc"
    assert bearer_token([(b"authorization", b"Basic abc")]) is None
    assert bearer_token([(b"authorization", b"Bearer ")]) is None
    assert bearer_token([(b"x-api-key", b"abc")]) is None


def test_which_paths_need_which_key() -> None:
    auth = APIKeyAuth(app=None, api_keys=[KEY_A], admin_keys=[ADMIN])  # type: ignore[arg-type]
    assert auth.check("/health", None) == (None, None)
    assert auth.check("/v1/chat/completions", None)[1] is not None
    assert auth.check("/v1/chat/completions", KEY_A) == (KEY_A, None)
    assert auth.check("/v1/chat/completions", ADMIN) == (ADMIN, None)  # admins may generate too
    admin_paths = ("/flush_cache", "/get_server_info", "/server_info", "/metrics")
    for admin_path in (
        *admin_paths,
        "/pause_generation",
        "/continue_generation",
        "/pause",
        "/resume",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/sleep",
        "/wake_up",
    ):
        assert auth.check(admin_path, KEY_A)[1] is not None
        assert auth.check(admin_path, ADMIN) == (ADMIN, None)
    for open_to_tenants in ("/is_paused", "/is_sleeping"):
        assert auth.check(open_to_tenants, KEY_A) == (KEY_A, None)
    user_keys_only = APIKeyAuth(app=None, api_keys=[KEY_A])  # type: ignore[arg-type]
    assert user_keys_only.check("/flush_cache", KEY_A) == (KEY_A, None)
    admin_only = APIKeyAuth(app=None, admin_keys=[ADMIN])  # type: ignore[arg-type]
    assert admin_only.check("/v1/completions", None) == (None, None)
    assert admin_only.check("/metrics", None)[1] is not None


def test_tenant_salt_is_bound_to_the_key() -> None:
    assert tenant_cache_salt(None, None) is None and tenant_cache_salt(None, "s") == "s"
    a, b = tenant_cache_salt(KEY_A, None), tenant_cache_salt(KEY_B, None)
    assert a != b and a == tenant_cache_salt(KEY_A, None)
    assert tenant_cache_salt(KEY_A, "s") not in (a, tenant_cache_salt(KEY_B, "s"), "s")
    # A client of key B cannot pick key A's salt by sending it as its own.
    assert tenant_cache_salt(KEY_B, a) != a


# ---------------------------------------------------------------------------- a gateway with keys


@pytest.fixture(scope="module")
def keyed(server: Any, tokenizer: Any) -> Iterator[str]:
    """A gateway with two tenant keys and an admin key, for the session server's router."""
    config = GatewayConfig(
        router=server.endpoint,
        api_keys=(KEY_A, KEY_B),
        admin_api_keys=(ADMIN,),
        memory_log_interval_s=0,
    )
    http = HTTPGateway(config, "127.0.0.1", 0, tokenizer=tokenizer).start()
    try:
        yield http.url
    finally:
        http.stop()


def _openai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _prompt() -> list[Any]:
    # Fresh per test: nothing of it is cached before the test runs.
    return [
        {"role": "user", "content": f"Tell me about radix trees, case {uuid.uuid4().hex}. " * 3}
    ]


def _cached(client: openai.OpenAI, messages: list[Any], salt: str | None = None) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    out = client.chat.completions.create(
        model="default", messages=messages, max_tokens=1, temperature=0, extra_body=extra
    )
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return out.usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.slow
def test_openai_client_needs_the_key(keyed: str) -> None:
    for key in ("", "sk-wrong", KEY_A + "0"):
        with pytest.raises(openai.AuthenticationError) as exc:
            _openai(keyed, key or "unset").models.list()
        assert exc.value.status_code == 401
        body = exc.value.response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert (
            body["error"]["code"] == "invalid_api_key"
            and exc.value.response.headers["www-authenticate"]
        )
    with httpx.Client(base_url=keyed, timeout=30) as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": "default", "messages": _prompt(), "max_tokens": 1},
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/generate", json={"text": "hi"}).status_code == 401
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            assert c.post(path, json=body).status_code == 401
        assert c.get("/v1/responses/resp_x").status_code == 401
        assert c.delete("/v1/responses/resp_x").status_code == 401
        assert c.get("/v1/responses/resp_x/input_items").status_code == 401
        assert c.get("/tokenizer_info").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": f"Basic {KEY_A}"}).status_code == 401
        assert c.get("/health").status_code == 200  # probes carry no key
    for key in (KEY_A, KEY_B, ADMIN):
        client = _openai(keyed, key)
        assert client.models.list().data
        out = client.chat.completions.create(
            model="default", messages=_prompt(), max_tokens=2, temperature=0
        )
        assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_admin_endpoints_need_the_admin_key(keyed: str) -> None:
    with httpx.Client(base_url=keyed, timeout=30) as c:
        for method, path in (
            ("POST", "/flush_cache"),
            ("GET", "/get_server_info"),
            ("GET", "/server_info"),
            ("GET", "/metrics"),
        ):
            for headers in ({}, {"Authorization": f"Bearer {KEY_A}"}):
                r = c.request(method, path, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
            r = c.request(method, path, headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code in (200, 400), (
                path,
                r.text,
            )  # 400: flush refused while a request runs
        # Loading adapters reads the workers' disks and changes what every tenant is served.
        for path in ("/load_lora_adapter", "/v1/load_lora_adapter"):
            body = {"lora_name": "x", "lora_path": "/etc"}
            for headers in ({}, {"Authorization": f"Bearer {KEY_A}"}):
                assert c.post(path, headers=headers, json=body).status_code == 401
            r = c.post(path, headers={"Authorization": f"Bearer {ADMIN}"}, json=body)
            assert r.status_code == 400 and "adapter_config.json is missing" in r.text, r.text
        for path in ("/unload_lora_adapter", "/v1/unload_lora_adapter"):
            assert c.post(path, json={"lora_name": "x"}).status_code == 401
        # So does updating the weights; /abort_request takes any key (its own tenant's only).
        body = {"model_path": "/etc"}
        for headers in ({}, {"Authorization": f"Bearer {KEY_A}"}):
            assert (
                c.post("/update_weights_from_disk", headers=headers, json=body).status_code == 401
            )
        r = c.post(
            "/update_weights_from_disk", headers={"Authorization": f"Bearer {ADMIN}"}, json=body
        )
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        # So do memory releases: a malformed one (400) shows the admin key was let through.
        for path, query in (
            ("/release_memory_occupation", {}),
            ("/resume_memory_occupation", {}),
            ("/sleep", {"level": "3"}),
            ("/wake_up", {"tags": "gpu"}),
        ):
            body = {"tags": ["gpu"]}
            for headers in ({}, {"Authorization": f"Bearer {KEY_A}"}):
                r = c.post(path, headers=headers, params=query, json=body)
                assert r.status_code == 401, (path, r.text)
            r = c.post(path, headers={"Authorization": f"Bearer {ADMIN}"}, params=query, json=body)
            assert r.status_code == 400, (path, r.text)
        asleep = c.get("/is_sleeping", headers={"Authorization": f"Bearer {KEY_A}"})
        assert asleep.json() == {"is_sleeping": False}
        assert c.post("/abort_request", json={"abort_all": True}).status_code == 401
        mine = c.post(
            "/abort_request", headers={"Authorization": f"Bearer {KEY_A}"}, json={"abort_all": True}
        )
        assert mine.status_code == 200, mine.text
        r = c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        assert 'radixserve_http_errors_total{status="401"}' in r.text  # refusals are counted


@pytest.mark.slow
def test_tenants_share_nothing(keyed: str) -> None:
    a, b = _openai(keyed, KEY_A), _openai(keyed, KEY_B)
    msgs = _prompt()
    assert _cached(a, msgs) == 0
    assert _cached(a, msgs) > 0  # the same tenant reuses its prefix
    assert _cached(b, msgs) == 0  # another key: nothing of A's cache shows
    assert _cached(b, msgs) > 0
    # A tenant's own salt splits its cache further; it cannot reach another tenant's cache.
    assert _cached(a, msgs, salt="team-1") == 0
    assert _cached(a, msgs, salt="team-1") > 0
    assert _cached(b, msgs, salt="team-1") == 0
    assert _cached(b, msgs, salt=tenant_cache_salt(KEY_A, None)) == 0  # A's derived salt, sent by B


@pytest.mark.slow
def test_cache_salt_without_keys(server: Any) -> None:
    """On the keyless session gateway, ``cache_salt`` alone separates the caches."""
    client = _openai(server.url, "unused")
    msgs = _prompt()
    assert _cached(client, msgs, salt="alpha") == 0
    assert _cached(client, msgs, salt="alpha") > 0
    assert _cached(client, msgs, salt="beta") == 0
    assert _cached(client, msgs) == 0  # no salt: the shared cache, not alpha's
    prompt = "Completions share the salt rules too. " * 4 + uuid.uuid4().hex
    kw: dict[str, Any] = dict(model="default", prompt=prompt, max_tokens=1, temperature=0)
    cached = []
    for salt in ("alpha", "alpha", "gamma"):
        usage = client.completions.create(**kw, extra_body={"cache_salt": salt}).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
    with httpx.Client(base_url=server.url, timeout=60) as c:
        body: dict[str, Any] = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
        assert (
            c.post("/generate", json={**body, "cache_salt": "alpha"}).json()["meta_info"][
                "cached_tokens"
            ]
            > 0
        )
        assert (
            c.post("/generate", json={**body, "cache_salt": "delta"}).json()["meta_info"][
                "cached_tokens"
            ]
            == 0
        )
        r = c.post("/generate", json={**body, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
