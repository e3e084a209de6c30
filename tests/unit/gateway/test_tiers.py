from __future__ import annotations

import pytest

from gateway.admission.tiers import (KEYS_ENV, Caller, TierConfigError, TierError, TierErrorKind,
                                     classify, load_tier_config, resolve)

TIERS_TOML = """
default_tier = "standard"

[tiers.interactive]
ttft_ms = 300
local_prefill_max_tokens = 100

[tiers.gold]
priority = 0
ttft_ms = 200
tpot_ms = 40
max_queued = 8
max_running = 16
tokens_per_min = 5000
local_prefill_max_tokens = 50

[[keys]]
key = "sk-alice"
name = "alice"
tier = "interactive"

[[keys]]
key_env = "BOB_KEY"
name = "bob"
tier = "batch"
allow_tier_header = true
admin = true
"""


def test_no_file_no_keys_is_open_with_builtin_tiers():
    config = load_tier_config(None, {})
    assert config.is_open
    assert set(config.tiers) == {"interactive", "standard", "batch"}
    decision = resolve(None, None, config)
    assert decision.tier.name == "standard" and decision.key_id is None
    assert decision.is_admin  # an open API has no admin key to ask for
    # The open API honours the tier header ...
    assert resolve("anything", "interactive", config).tier.name == "interactive"
    # ... but not a tier that does not exist.
    error = resolve(None, "platinum", config)
    assert isinstance(error, TierError) and error.kind is TierErrorKind.UNKNOWN_TIER
    assert error.kind.status == 400


def test_wait_limits_interactive_is_refused_at_its_target_the_others_wait():
    config = load_tier_config(None, {})
    assert [config.tiers[t].wait_limit_ms for t in ("interactive", "standard", "batch")] == [
        500, 300_000, 600_000]
    changed = load_tier_config("[tiers.standard]\nmax_wait_ms = 2000\n"
                               "[tiers.gold]\npriority = 0\nttft_ms = 100\ntpot_ms = 10\n"
                               "max_queued = 1\nmax_running = 1", {})
    assert changed.tiers["standard"].wait_limit_ms == 2000
    assert changed.tiers["gold"].max_wait_ms is None  # optional for a new tier
    assert changed.tiers["gold"].wait_limit_ms == 100


def test_file_overrides_builtin_fields_and_adds_tiers():
    config = load_tier_config(TIERS_TOML, {"BOB_KEY": "sk-bob"})
    assert config.tiers["interactive"].ttft_ms == 300
    assert config.tiers["interactive"].tpot_ms == 50  # untouched built-in value
    assert config.tiers["gold"].tokens_per_min == 5000
    assert not config.is_open


def test_key_maps_to_its_tier_and_header_needs_permission():
    config = load_tier_config(TIERS_TOML, {"BOB_KEY": "sk-bob"})
    alice = resolve("sk-alice", None, config)
    assert alice.tier.name == "interactive" and alice.key_id == "alice" and not alice.is_admin
    refused = resolve("sk-alice", "batch", config)
    assert isinstance(refused, TierError) and refused.kind is TierErrorKind.TIER_NOT_ALLOWED
    bob = resolve("sk-bob", None, config)
    assert bob.tier.name == "batch" and bob.is_admin
    assert resolve("sk-bob", "gold", config).tier.name == "gold"


def test_missing_and_wrong_keys_are_401():
    config = load_tier_config(TIERS_TOML, {"BOB_KEY": "sk-bob"})
    for key, kind in ((None, TierErrorKind.MISSING_KEY), ("", TierErrorKind.MISSING_KEY),
                      ("sk-mallory", TierErrorKind.INVALID_KEY)):
        error = resolve(key, None, config)
        assert isinstance(error, TierError) and error.kind is kind and kind.status == 401


def test_local_prefill_threshold_is_per_tier():
    config = load_tier_config(TIERS_TOML, {"BOB_KEY": "sk-bob"})
    alice, bob = resolve("sk-alice", None, config), resolve("sk-bob", "gold", config)
    assert isinstance(alice, Caller) and isinstance(bob, Caller)
    def decide(caller: Caller, prompt_len: int):
        return classify(caller, prompt_len, 16, config)

    assert decide(alice, 99).local_prefill and not decide(alice, 100).local_prefill
    assert decide(bob, 49).local_prefill and not decide(bob, 50).local_prefill
    assert decide(alice, 99).key_id == "alice" and decide(bob, 1).tier.name == "gold"


def test_classification_computes_the_targets_and_wire_priority_once():
    config = load_tier_config(None, {})
    tiers = config.tiers
    urgent, relaxed = resolve(None, "interactive", config), resolve(None, "batch", config)
    assert isinstance(urgent, Caller) and isinstance(relaxed, Caller)
    first, last = classify(urgent, 10, 64, config), classify(relaxed, 10, 0, config)
    # The protocol runs larger priorities first; a tier's smaller number is more urgent.
    assert first.wire_priority == -tiers["interactive"].priority > last.wire_priority
    assert first.targets.ttft_s == tiers["interactive"].ttft_ms / 1000
    assert first.targets.tpot_s == tiers["interactive"].tpot_ms / 1000
    assert first.targets.max_tokens == 64 and last.targets.max_tokens == 1
    strictest = min(t.tpot_ms for t in tiers.values()) / 1000
    assert first.targets.strictest_tpot_s == last.targets.strictest_tpot_s == strictest


def test_keys_from_env_with_flags():
    env = {KEYS_ENV: "sk-one, sk-two:batch, sk-three:interactive:header+admin"}
    config = load_tier_config(None, env)
    assert resolve("sk-one", None, config).tier.name == "standard"
    assert resolve("sk-two", None, config).tier.name == "batch"
    three = resolve("sk-three", "batch", config)
    assert three.tier.name == "batch" and three.is_admin
    assert "sk-" not in three.key_id  # the key itself never shows in logs


@pytest.mark.parametrize("toml_text, env, message", [
    ("default_tier = 'gold'", {}, "default_tier"),
    ("[tiers.gold]\nttft_ms = 1", {}, "new tier and needs"),
    ("[tiers.standard]\nttft_ms = 'fast'", {}, "must be a number"),
    ("[tiers.standard]\nttft_ms = -5", {}, "must be positive"),
    ("[tiers.standard]\nmax_wait_ms = 0", {}, "max_wait_ms must be positive"),
    ("[tiers.standard]\nmax_wait_ms = true", {}, "must be a number"),
    ("[tiers.standard]\nspeed = 5", {}, "unknown field"),
    ("[[keys]]\nkey = 'a'\ntier = 'nope'", {}, "unknown tier"),
    ("[[keys]]\nkey = 'a'\ntier = 'batch'\n[[keys]]\nkey = 'a'\ntier = 'batch'", {}, "twice"),
    ("[[keys]]\nkey_env = 'MISSING'\ntier = 'batch'", {}, "MISSING"),
    ("[[keys]]\ntier = 'batch'", {}, "exactly one of"),
    ("not toml = = =", {}, "tiers file"),
    (None, {KEYS_ENV: "sk-x:batch:root"}, KEYS_ENV),
])
def test_invalid_configuration_fails_with_a_clear_message(toml_text, env, message):
    with pytest.raises(TierConfigError, match=message):
        load_tier_config(toml_text, env)
