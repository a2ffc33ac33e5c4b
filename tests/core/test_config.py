import dataclasses

import pytest

from moetron.core.config import Config, ConfigError, StrEnum, parse_size


class Color(StrEnum):
    red = "red"
    blue = "blue"


@dataclasses.dataclass
class Inner(Config):
    n_layers: int = 2
    lr: float = 1e-3
    window: int | None = None
    color: Color = Color.red
    paths: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Outer(Config):
    model: Inner = dataclasses.field(default_factory=Inner)
    name: str = "run"
    flag: bool = False


def test_overrides_are_typed():
    cfg = Outer().apply_overrides(
        ["--model.n_layers=4", "--model.lr=3e-4", "--model.window=null", "--model.color=blue",
         "--model.paths=[a.bin,b.bin]", "--flag=true", "name=x"]
    )
    assert cfg.model.n_layers == 4 and cfg.model.lr == 3e-4 and cfg.model.window is None
    assert cfg.model.color is Color.blue and cfg.model.paths == ["a.bin", "b.bin"]
    assert cfg.flag is True and cfg.name == "x"


def test_auto_names_none_only_where_the_config_says_so():
    """``auto`` is None for the fields a config names in AUTO_NONE (their None is the run's choice), from the
    command line and from a mapping; any other field keeps its meaning: an error for an int, a string where it
    takes strings (None may mean off there: a sliding window, a capacity factor)."""

    @dataclasses.dataclass
    class Fields(Config):
        AUTO_NONE = frozenset({"on", "color"})
        on: bool | None = True
        color: Color | None = Color.red
        window: int | None = 4
        label: str | None = None

    cfg = Fields().apply_overrides(["--on=auto", "--color=AUTO", "--label=auto"])
    assert cfg.on is None and cfg.color is None and cfg.label == "auto" and cfg.window == 4
    assert Fields.from_dict({"on": "auto", "color": "blue"}).on is None
    with pytest.raises(ConfigError, match="window"):
        Fields().apply_overrides(["--window=auto"])
    from moetron.models import ModelConfig

    with pytest.raises(ConfigError, match="sliding_window"):  # None is "no window" there, not a choice
        ModelConfig().apply_overrides(["--sliding_window=auto"])


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'model.n_layer'.*n_layers"):
        Outer().apply_overrides(["--model.n_layer=4"])
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'.*model"):
        Outer.from_dict({"modle": {}})


def test_wrong_types():
    with pytest.raises(ConfigError, match=r"model.n_layers: expected an integer, got 'four'"):
        Outer().apply_overrides(["--model.n_layers=four"])
    with pytest.raises(ConfigError, match=r"model.color: 'green' is not one of 'red', 'blue'"):
        Outer.from_dict({"model": {"color": "green"}})
    with pytest.raises(ConfigError, match="expected true or false"):
        Outer().apply_overrides(["--flag=maybe"])
    with pytest.raises(ConfigError, match=r"model.window: 'seven' is not a valid int \| None"):
        Outer().apply_overrides(["--model.window=seven"])
    with pytest.raises(ConfigError, match=r"'model.color' is a value, not a nested config"):
        Outer().apply_overrides(["--model.color.x=1"])
    with pytest.raises(ConfigError, match="must look like"):
        Outer().apply_overrides(["--flag"])


def test_yaml_round_trip(tmp_path):
    cfg = Outer().apply_overrides(["--model.color=blue", "--model.paths=[x]", "--model.window=7"])
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    assert Outer.from_yaml(path) == cfg
    assert "color: blue" in path.read_text()


def test_missing_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Outer.from_yaml(tmp_path / "nope.yaml")


def test_parse_size_decimal_and_binary_units():
    decimal = {"4096": 4096, "100B": 100, "4K": 4000, "5GB": 5_000_000_000, "1.5kb": 1500, " 2 TB ": 2 * 10**12,
               "500M": 500_000_000}
    binary = {"4Ki": 4096, "64KiB": 65536, "500MiB": 524_288_000, "1gib": 1_073_741_824, "1Ti": 1_099_511_627_776}
    for text, size in {**decimal, **binary}.items():
        assert parse_size(text, "x") == size, text
    assert parse_size(7, "x") == 7
    for bad in ("1X", "0", "KB", "1iB", "1.2.3", "-1K", "0.5"):
        with pytest.raises(ConfigError, match=r"--sizes .* is not a positive size.*powers of 1000.*powers of 1024"):
            parse_size(bad, "--sizes")


@pytest.mark.parametrize("override,message", [
    ("--eps=0", r"optimizer\.eps must be a positive finite number.*got 0\.0.*--optimizer\.eps=1e-8"),
    ("--eps=-1e-8", r"optimizer\.eps must be a positive"),
    ("--eps=inf", r"optimizer\.eps must be a positive finite number.*got inf"),
    ("--lr=nan", r"optimizer\.lr must be a positive finite number, got nan.*--optimizer\.lr="),
    ("--lr=inf", r"optimizer\.lr must be a positive finite number, got inf"),
    ("--lr=0", r"optimizer\.lr must be a positive"),
    ("--weight_decay=nan", r"optimizer\.weight_decay must be a finite number >= 0, got nan"),
])
def test_optimizer_range_checks(override, message):
    from moetron.core.optim import OptimizerConfig

    cfg = OptimizerConfig().apply_overrides([override])
    with pytest.raises(ConfigError, match=message):
        cfg.validate()
