"""napkin.sizes.parse_pairs: the one parser of the command line's WIRE=N
pairs (napkin demo|cost|plan|render|report|bench --size, the AOT report's -D
and -O), and each command's use of it."""
import pytest

from napkin.errors import NapkinError
from napkin.sizes import parse_pairs


def test_good_pairs():
    assert parse_pairs([]) == {}
    assert parse_pairs(["q=4096", "x=1024"]) == {"q": 4096, "x": 1024}
    assert parse_pairs([" q = 7 ", "h=007"]) == {"q": 7, "h": 7}


@pytest.mark.parametrize("item, message", [
    ("q", "napkin: --size expects WIRE=N with N a positive whole number, not 'q'"),
    ("=4", "napkin: --size expects WIRE=N with N a positive whole number, not '=4'"),
    (" =4", "napkin: --size expects WIRE=N with N a positive whole number, not ' =4'"),
    ("q=", "napkin: --size q=: the size of q must be a positive whole number, not ''"),
    ("q=0", "napkin: --size q=0: the size of q must be a positive whole number, not '0'"),
    ("q=-1", "napkin: --size q=-1: the size of q must be a positive whole number, not '-1'"),
    ("q=+4", "napkin: --size q=+4: the size of q must be a positive whole number, not '+4'"),
    ("q=1.5", "napkin: --size q=1.5: the size of q must be a positive whole number, not '1.5'"),
    ("q=lots", "napkin: --size q=lots: the size of q must be a positive whole number, not 'lots'"),
    ("q=4=5", "napkin: --size q=4=5: the size of q must be a positive whole number, not '4=5'"),
    # str.isdigit() takes these; int() refuses the first (it used to escape as a ValueError).
    ("q=\u00b2", "napkin: --size q=\u00b2: the size of q must be a positive whole number, not '\u00b2'"),
    ("q=\u0661\u0662", "napkin: --size q=\u0661\u0662: the size of q must be a positive whole number, "
                       "not '\u0661\u0662'"),
])
def test_bad_pair_messages(item, message):
    with pytest.raises(NapkinError) as info:
        parse_pairs([item])
    assert str(info.value) == message


def test_a_name_given_twice_is_refused_even_with_the_same_value():
    for second in ("q=8", "q=4", " q =4"):
        with pytest.raises(NapkinError) as info:
            parse_pairs(["q=4", second])
        assert str(info.value) == f"napkin: --size {second}: q is already given (q=4)"


def test_flag_key_what_and_filename_name_the_caller():
    with pytest.raises(NapkinError) as info:
        parse_pairs(["num_warps"], "-O", key="NAME", what="launcher option", filename="prog")
    assert str(info.value) == "prog: -O expects NAME=N with N a positive whole number, not 'num_warps'"
    with pytest.raises(NapkinError) as info:
        parse_pairs(["num_warps=0"], "-O", key="NAME", what="launcher option", filename="prog")
    assert str(info.value) == "prog: -O num_warps=0: launcher option num_warps must be a positive whole number, not '0'"


def test_every_command_uses_it(capsys):
    """One bad size, every command that takes sizes: the same words, exit 1."""
    from pathlib import Path

    from napkin.bench import aot
    from napkin.cli import main

    f = str(Path(__file__).resolve().parents[1] / "examples" / "attention.ncd")
    word = "--size q=0: the size of q must be a positive whole number, not '0'"
    for argv in (["cost", f, "-D", "q=0"], ["plan", f, "--devices", "2", "-D", "q=0"],
                 ["render", f, "-o", "x.dot", "--size", "q=0"], ["report", f, "--size", "q=0"],
                 ["demo", f, "--size", "q=0"], ["bench", f, "--size", "q=0"]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert word in err and "Traceback" not in err, (argv, err)
    assert aot.main([f, "-D", "q=0"]) == 1
    assert "-D q=0: the size of q must be a positive whole number, not '0'" in capsys.readouterr().err
    assert aot.main([f, "-O", "num_warps"]) == 1
    assert "-O expects NAME=N with N a positive whole number, not 'num_warps'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["4611686018427387905", "1" + "0" * 400])
def test_a_size_past_two_to_the_62_is_refused_in_words(value):
    """-D q=10^400 reached the cost pass's floats: an internal OverflowError (exit 2)."""
    with pytest.raises(NapkinError) as err:
        parse_pairs([f"q={value}"], "--size")
    shown = value if len(value) <= 30 else value[:27] + "..."
    assert str(err.value) == f"napkin: --size q={shown}: the size of q is more than napkin takes (2^62)"
    assert parse_pairs([f"q={2 ** 62}"]) == {"q": 2 ** 62}
