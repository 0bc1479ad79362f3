"""Config files that would hang or crash the loader are refused with a ConfigError naming the file:
an alias bomb ("billion laughs"), deep or self-referring nesting, bytes that are not UTF-8."""

import signal
import time

import pytest

from ember.config import ConfigError, load_config


@pytest.fixture
def deadline():
    """Fail instead of hanging: the loader must answer within 20 s (the alias bomb took minutes)."""
    def expired(*_):
        raise TimeoutError("the config loader took more than 20 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def alias_bomb(levels: int) -> str:
    """A free-form mapping whose last alias expands to 9**levels strings (about 500 bytes for 9 levels)."""
    lines = ["custom_reward_function:", "  reward_kwargs:", "    a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_billion_laughs_file_is_refused_at_once_naming_the_file(tmp_path, deadline):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(9))
    assert path.stat().st_size < 1024
    started = time.monotonic()
    with pytest.raises(ConfigError, match=rf"{path} cannot be used as a config: its aliases \(\*name\) expand to "
                                          r"[\d,]+ more values .* limit of 10,000"):
        load_config([], str(tmp_path), "bomb")
    assert time.monotonic() - started < 5


def test_aliases_and_merge_keys_within_the_limit_still_load(tmp_path):
    (tmp_path / "anchors.yaml").write_text(
        "custom_reward_function:\n  reward_kwargs:\n    base: &base {x: 1, y: [1, 2]}\n"
        "    other:\n      <<: *base\n      z: 3\n    list: &list [a, b]\n    again: *list\n")
    kwargs = load_config([], str(tmp_path), "anchors").custom_reward_function.reward_kwargs
    assert kwargs["other"] == {"x": 1, "y": [1, 2], "z": 3} and kwargs["again"] == ["a", "b"]


@pytest.mark.parametrize("value, reason", [
    ("[" * 1000 + "]" * 1000, "it nests mappings or lists more than 32 levels deep"),
    ("{a: " * 60 + "1" + "}" * 60, "it nests mappings or lists more than 32 levels deep"),
    ("&a [1, *a]", "an alias refers to a mapping or list that contains it"),
])
def test_pathological_nesting_is_refused_naming_the_file(tmp_path, deadline, value, reason):
    path = tmp_path / "deep.yaml"
    path.write_text(f"custom_reward_function:\n  reward_kwargs:\n    x: {value}\n")
    with pytest.raises(ConfigError, match=rf"{path} cannot be used as a config: {reason}"):
        load_config([], str(tmp_path), "deep")


def test_a_file_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("trainer:\n  project_name: café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"{path} is not UTF-8 text \(byte 0xe9 at offset 28\); save it as UTF-8"):
        load_config([], str(tmp_path), "latin1")


def test_a_deep_command_line_value_is_refused_as_an_override():
    with pytest.raises(ConfigError, match=r"cannot read the value of override .* more than 32 levels deep"):
        load_config(["+custom_reward_function.reward_kwargs.x=" + "[" * 1000 + "]" * 1000])


def test_a_key_written_twice_is_refused_naming_both_lines(tmp_path):
    from ember.config.yaml_io import read_yaml_file

    path = tmp_path / "twice.yaml"
    path.write_text("actor:\n  lr: 1e-6\n  clip: 0.2\n  lr: 1e-5\n")
    with pytest.raises(ConfigError, match=r"the key 'lr' is written twice \(lines 2 and 4\)"):
        read_yaml_file(str(path))
    merged = tmp_path / "merged.yaml"  # a merge key and the keys it is overridden by are not duplicates
    merged.write_text("base: &base {lr: 1, clip: 2}\nactor:\n  <<: *base\n  lr: 3\n")
    assert read_yaml_file(str(merged))["actor"] == {"lr": 3, "clip": 2}
