"""Structured outputs and logit controls through ``tpspec serve`` (the tiny model at TP = 2 on CPU)
with the official ``openai`` client: ``response_format`` json_schema and json_object return JSON
that parses and validates, vLLM's ``structured_outputs`` field constrains completions, OpenAI's
``logit_bias`` forces a token, and a bad schema or a malformed field is a 400 naming it."""

from __future__ import annotations

import json

import pytest

from test_serve import MODEL, Server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# llguidance's own schema option: compact JSON (the tiny model otherwise fills any allowed
# whitespace with newlines until max_tokens).
COMPACT = {"x-guidance": {"whitespace_flexible": False}}
ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "score"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5}},
          **COMPACT}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tpspec.runtime.llm import tiny_model_path

    srv = Server(tiny_model_path(), tmp_path_factory.mktemp("serve_structured") / "server.log")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema_gives_valid_json(server, temperature):
    c = server.client
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                      max_tokens=48, temperature=temperature, seed=3, response_format=fmt)
    jsonschema.validate(json.loads(reply.choices[0].message.content), ANSWER)
    assert reply.choices[0].finish_reason == "stop"
    chunks = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       max_tokens=48, temperature=temperature, seed=3, response_format=fmt, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reply.choices[0].message.content
    done = c.completions.create(model=MODEL, prompt="The answer:", max_tokens=48, temperature=temperature, seed=4,
                                extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(done.choices[0].text), ANSWER)


def test_json_object_and_vllm_structured_outputs(server):
    c = server.client
    obj = c.completions.create(model=MODEL, prompt="The cat", max_tokens=64, temperature=1.0, seed=1,
                               extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].text), dict)
    reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a color."}],
                                      max_tokens=8, temperature=1.0, seed=2, response_format={"type": "json_object"})
    assert reply.choices[0].message.content.startswith("{")
    colors = ["red", "green", "blue"]
    for seed in range(4):
        pick = c.completions.create(model=MODEL, prompt="A color:", max_tokens=8, temperature=1.0, seed=seed,
                                    extra_body={"structured_outputs": {"choice": colors}})
        assert pick.choices[0].text in colors and pick.choices[0].finish_reason == "stop"
    plain = c.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0)
    text = c.completions.create(model=MODEL, prompt="The cat", max_tokens=8, temperature=0,
                                extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == plain.choices[0].text


def test_logit_bias_allowed_token_ids_and_bad_words(server):
    c = server.client
    tok = server_tokenizer()
    dog = tok.encode(" dog", add_special_tokens=False)[-1]
    forced = c.completions.create(model=MODEL, prompt="The cat sat", max_tokens=6, temperature=1.0, seed=1,
                                  logit_bias={str(dog): 100})
    assert forced.choices[0].text == " dog" * 6
    allowed = [tok.encode(w, add_special_tokens=False)[-1] for w in (" the", " cat", ".")]
    kept = c.completions.create(model=MODEL, prompt="The cat sat", max_tokens=10, temperature=1.0, seed=1,
                                extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert set(tok.encode(kept.choices[0].text, add_special_tokens=False)) <= set(allowed)
    banned = c.completions.create(model=MODEL, prompt="The cat sat", max_tokens=16, temperature=0,
                                  extra_body={"bad_words": ["."]})
    assert "." not in banned.choices[0].text


def server_tokenizer():
    from tpspec.runtime.llm import tiny_model_path
    from tpspec.runtime.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model_path())


@pytest.mark.parametrize("extra,match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "json is invalid.*bogus"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be one of"),
    ({"structured_outputs": {"regex": "a(b"}}, "regex is invalid"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"pattern": "a"}}, "unknown field"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ({"logit_bias": {"dog": 5}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 500}}, r"logit_bias values must be floats in \[-100, 100\]"),
    ({"logit_bias": {"99999": 1}}, "token ids outside"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
])
def test_bad_controls_get_400(server, extra, match):
    import re

    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(model=MODEL, prompt="The cat", max_tokens=4, extra_body=extra)
    assert re.search(match, err.value.response.json()["error"]["message"], re.S), err.value.response.json()
    assert server.client.completions.create(model=MODEL, prompt="The cat", max_tokens=2).choices[0].text is not None
