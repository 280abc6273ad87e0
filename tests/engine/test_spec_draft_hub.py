"""A speculative draft model named by a Hugging Face id (`speculative_config.model`, at its
own `revision`) is resolved through the hub cache as the target model is: offline from a
populated cache, in `LLM(speculative_config=...)`, `tandem worker --speculative-config` and
`tandem serve`'s workers; a draft missing offline is a one-line error naming the key."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.engine.config import EngineConfig
from tandem.engine.errors import ConfigError
from tandem.engine.llm import resolve_config
from tandem.engine.spec_decode.config import SpeculativeConfig
from tandem.serving.embedded import hub_env
from tests.engine.utils import make_tiny_model_dir
from tests.hub_cache import add_model_dir, go_offline, no_network, snapshot_of
from tests.serving.helpers import free_port

DRAFT = "org/tiny-draft"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(a local tiny target, HF_HOME whose cache holds DRAFT: `main` one tiny Llama sharing
    the target's tokenizer, `v1` another)."""
    root = tmp_path_factory.mktemp("draft-hub")
    target = root / "target"
    make_tiny_model_dir(target, tokenizer="trained", seed=1)
    for seed, refs in ((2, ("v1",)), (3, ("main",))):
        draft = root / f"draft{seed}"
        make_tiny_model_dir(draft, tokenizer="trained", seed=seed)
        add_model_dir(root / "hf" / "hub", DRAFT, draft, refs=refs)
    return target, root / "hf"


@pytest.fixture
def offline(models, monkeypatch) -> tuple[Path, Path]:
    go_offline(monkeypatch, models[1])
    return models


def snapshot(hub_home: Path, ref: str) -> str:
    return snapshot_of(hub_home, DRAFT, ref)


def _draft(**keys) -> dict:
    return {"method": "draft", "model": DRAFT, "num_speculative_tokens": 2, **keys}


def test_a_draft_id_resolves_to_its_snapshot_at_its_own_revision(offline):
    target, home = offline
    with no_network() as tries:
        main_ = resolve_config(EngineConfig(model=str(target), speculative_config=_draft()))
        v1 = resolve_config(EngineConfig(model=str(target), revision="ignored-for-the-draft",
                                         speculative_config=_draft(revision="v1")))
    assert tries == []
    assert main_.speculative_config.model == snapshot(home, "main")
    assert v1.speculative_config == SpeculativeConfig(**_draft(revision="v1",
                                                               model=snapshot(home, "v1")))
    assert resolve_config(main_) is main_  # already local: unchanged
    selfish = EngineConfig(model=str(target), speculative_config={"method": "draft",
                                                                  "model": "self"})
    assert resolve_config(selfish).speculative_config.model == "self"


def test_llm_speculates_with_a_draft_from_the_cache_offline(offline):
    from tandem import LLM, SamplingParams

    target, home = offline
    with no_network() as tries:
        llm = LLM(model=str(target), device="cpu", num_kv_blocks=64, max_num_seqs=2,
                  max_model_len=64, speculative_config=_draft(adaptive=False))
        assert llm.engine.config.speculative_config.model == snapshot(home, "main")
        out = llm.generate([[5, 9, 14, 30, 7]], SamplingParams(max_tokens=6, temperature=0.0,
                                                               ignore_eos=True))
    assert tries == []
    assert len(out[0].outputs[0].token_ids) == 6
    assert llm.engine.stats().spec_num_drafts > 0


def test_a_draft_missing_offline_is_a_one_line_usage_error(offline, capsys):
    target, home = offline
    spec = json.dumps({"method": "draft", "model": "org/absent"})
    with no_network(), pytest.raises(SystemExit) as exit_:
        main(["worker", "--model", str(target), "--speculative-config", spec, "--port",
              str(free_port())])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "tandem worker: error: speculative_config.model: org/absent (revision main) is not in "
        f"the Hugging Face cache {home / 'hub'} and HF_HUB_OFFLINE=1 forbids downloading it: "
        "download it once online, or point HF_HUB_CACHE / HF_HOME at a cache that holds it")


def test_revision_is_a_draft_models_key():
    assert SpeculativeConfig.from_dict(_draft(revision="v1")).revision == "v1"
    with pytest.raises(ConfigError, match="speculative_config.revision applies to method "
                                          "'draft'"):
        SpeculativeConfig.from_dict({"method": "ngram", "revision": "v1"})
    with pytest.raises(ConfigError, match="revision must be a non-empty string"):
        SpeculativeConfig.from_dict(_draft(revision=3))


def test_serve_runs_its_workers_offline_when_the_draft_is_an_id(tmp_path):
    def args(spec: dict | None) -> argparse.Namespace:
        parsed = None if spec is None else SpeculativeConfig.from_dict(spec)
        return argparse.Namespace(model=str(tmp_path), tokenizer=None,
                                  speculative_config=parsed)

    assert hub_env(args(_draft())) == {"HF_HUB_OFFLINE": "1"}
    assert hub_env(args({"method": "draft", "model": "self"})) == {}
    assert hub_env(args({"method": "draft", "model": str(tmp_path)})) == {}
    assert hub_env(args(None)) == {}
