"""An int given to a parameter annotated as a union of ``int`` and ``float`` stays an int, however ``typing`` ordered
the union (``lit_gspo.lightning.int_before_float``): for Lightning's ``limit_*_batches`` an int is a number of batches
and a float a fraction, and under torch 2.11 ``--trainer.limit_val_batches 1`` (one batch) had become ``1.0`` (all).

``float | int`` builds the float-first union that ``typing``'s cache handed Lightning there (``types.UnionType`` keeps
the order it is written in, where ``Union[float, int]`` may return a cached ``Union[int, float]``)."""

import lightning.pytorch as pl
import pytest
from test_trainer_flags import QUICKSTART, fit_parser

from lit_gspo.lightning.cli import RLArgumentParser
from lit_gspo.lightning.int_before_float import int_before_float, int_or_float_parameters


class Limits:
    def __init__(self, batches: float | int | None = None, share: float | int = 0.5, rate: float = 1.0):
        """How much to take.

        Args:
            batches: an int counts, a float is a fraction
            share: the same, never None
            rate: a float only
        """


class Schedule:  # given by class path, as a callback or a logger is
    def __init__(self, start: float | int = 0.8):
        self.start = start


class Holder:
    def __init__(self, schedule: Schedule | None = None):
        self.schedule = schedule


def test_the_union_is_rebuilt_with_int_before_float_and_its_other_members_kept():
    assert int_before_float(float | int | None).__args__ == (int, float, type(None))
    assert int_before_float(str | float | int).__args__ == (int, float, str)
    assert set(int_or_float_parameters(Limits)) == {"batches", "share"}  # `rate` takes a float only
    assert int_or_float_parameters(Limits)["share"] == (float | int, 0.5)


@pytest.mark.parametrize(
    "given, expected", [("1", 1), ("2", 2), ("0", 0), ("1.0", 1.0), ("0.5", 0.5), ("null", None)], ids=str
)
def test_a_nested_class_argument_keeps_an_int_an_int(given, expected):
    parser = RLArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Limits, "limits")
    batches = parser.parse_args(["--limits.batches", given]).limits.batches
    assert batches == expected and type(batches) is type(expected)
    share = parser.parse_args(["--limits.share", "1"]).limits.share
    assert share == 1 and type(share) is int
    assert type(parser.parse_args(["--limits.rate", "1"]).limits.rate) is float  # unchanged: float only
    from_config = parser.parse_args(["--limits", '{"batches": 3}']).limits.batches
    assert from_config == 3 and type(from_config) is int
    assert "an int counts, a float is a fraction" in parser.format_help()  # its help as jsonargparse shows it


def test_a_class_given_by_its_path_keeps_an_int_an_int():
    parser = RLArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Holder, "holder")
    for given, expected in (("2", 2), ("0.25", 0.25)):
        cfg = parser.parse_args(["--holder.schedule", f"{__name__}.Schedule", "--holder.schedule.start", given])
        built = parser.instantiate_classes(cfg).holder.schedule
        assert built.start == expected and type(built.start) is type(expected)


@pytest.mark.parametrize("name", sorted(int_or_float_parameters(pl.Trainer)))
def test_every_int_or_float_trainer_flag_reads_an_int_as_an_int(name):
    """Enumerated from Lightning's Trainer: every flag of ``lit-gspo fit`` whose annotation holds int and float."""
    parser = fit_parser()
    for given, expected in (("1", 1), ("1.0", 1.0)):
        value = parser.parse_args([*QUICKSTART, f"--trainer.{name}", given]).trainer[name]
        assert value == expected and type(value) is type(expected), (name, given, value)


def test_the_trainer_has_int_or_float_flags_to_check():
    assert {"limit_train_batches", "limit_val_batches", "val_check_interval"} <= set(
        int_or_float_parameters(pl.Trainer)
    )
