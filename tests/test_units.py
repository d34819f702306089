"""Link rates and times as text (megatron_tawpipe.common.units): one convention, and tc's reading."""

import math
import re

import pytest

from megatron_tawpipe.common.units import parse_rate, parse_tc_rate, parse_time


# ---------------------------------------------------------------------------------------- parse_rate (bytes/s)
@pytest.mark.parametrize("text,bytes_per_s", [
    # upper-case B: bytes, every prefix (k/M/G/T = 1000^n, either case; Ki/Mi/Gi/Ti = 1024^n)
    ("7B/s", 7), ("2kB/s", 2e3), ("2KB/s", 2e3), ("3MB/s", 3e6), ("3mB/s", 3e6), ("200GB/s", 200e9),
    ("2TB/s", 2e12), ("1KiB/s", 1024), ("1MiB/s", 2 ** 20), ("1GiB/s", 2 ** 30), ("1TiB/s", 2 ** 40),
    ("10MBps", 10e6), ("1GBps", 1e9), ("1GiBps", 2 ** 30),
    # bits: the word bit (any case, /s optional), lower-case b/s and bps, GbE
    ("8bit/s", 1), ("8bit", 1), ("100kbit/s", 100e3 / 8), ("100Mbit/s", 100e6 / 8),
    ("100Gbit/s", 12.5e9), ("1Tbit/s", 1e12 / 8), ("1gbit", 1e9 / 8), ("1GBit/s", 1e9 / 8),
    ("1Gibit/s", 2 ** 30 / 8), ("100Gb/s", 12.5e9), ("1Mib/s", 2 ** 20 / 8), ("25Gbps", 25e9 / 8),
    ("10mbps", 10e6 / 8), ("80bps", 10), ("10GbE", 1.25e9), ("100gbe", 12.5e9),
    # no unit: bytes/s; numbers pass through; unlimited
    ("3e9", 3e9), ("1.5", 1.5), (3e9, 3e9), (7, 7.0), ("inf", math.inf), ("Infinite", math.inf),
    ("free", math.inf), (math.inf, math.inf),
    # spacing and number forms
    ("1.25 GB/s", 1.25e9), ("  12.5GB/s ", 12.5e9), (".5GB/s", 0.5e9), ("1e3MB/s", 1e9),
])
def test_parse_rate_units(text, bytes_per_s):
    assert parse_rate(text) == pytest.approx(bytes_per_s)


def test_parse_rate_bits_against_bytes():
    # Only the case of B/b carries meaning: one byte is eight bits, whatever the spelling.
    assert parse_rate("1GB/s") == 8 * parse_rate("1Gb/s") == 8 * parse_rate("1Gbit/s") == 8 * parse_rate("1Gbps")
    assert parse_rate("1GBps") == parse_rate("1GB/s") == 1e9
    assert parse_rate("1gbit/s") == parse_rate("1Gbit/s") == parse_rate("1GBIT/s")


def test_the_flags_simulate_takes_are_read_as_before():
    # tools/simulate.py --intra-bw/--inter-bw defaults and the values the README, examples and tests pass
    assert parse_rate("200GB/s") == 200e9 and parse_rate("12.5GB/s") == 12.5e9
    assert parse_rate("450GB/s") == 450e9 and parse_rate("1.25GB/s") == 1.25e9
    assert parse_rate("10Gbit/s") == 1.25e9 and parse_rate("25Gbit/s") == 3.125e9
    assert parse_rate("0.6GB/s") == 0.6e9 and parse_rate("100MB/s") == 100e6
    # tools/tawpipe_lab/matrix.py: a tc rate + '/s'
    assert parse_rate("500mbit/s") == 62.5e6 and parse_rate("2gbit/s") == 250e6


@pytest.mark.parametrize("bad", ["fast", "", "GB/s", "-5GB/s", "5GB", "5 gigabytes/s", "5GiBit/s/s", "5Xb/s",
                                 "5BPS", "1,5GB/s", "1e", "0GB/s", "0", 0, -1.0, float("nan"), None, True, [1]])
def test_parse_rate_refuses_bad_input_naming_it(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_rate(bad)


def test_parse_rate_unknown_unit_names_the_unit():
    with pytest.raises(ValueError, match=r"unknown rate unit 'Gb' in '5Gb'"):
        parse_rate("5Gb")


# ------------------------------------------------------------------------------------- parse_tc_rate (bits/s)
@pytest.mark.parametrize("text,bits_per_s", [
    ("100bit", 100), ("500kbit", 500e3), ("100mbit", 100e6), ("50mbit", 50e6), ("1gbit", 1e9),
    ("1.5Gbit", 1.5e9), ("2tbit", 2e12), ("1kibit", 1024), ("1mibit", 2 ** 20), ("1gibit", 2 ** 30),
    ("1tibit", 2 ** 40), ("1MBIT", 1e6),
    # tc: bps is BYTES per second, in any case
    ("10bps", 80), ("10kbps", 80e3), ("10mbps", 80e6), ("10MBps", 80e6), ("10Mbps", 80e6),
    ("1gbps", 8e9), ("1tbps", 8e12), ("1kibps", 8 * 1024), ("1MiBps", 8 * 2 ** 20), ("1gibps", 8 * 2 ** 30),
    (" 100mbit ", 100e6),
])
def test_parse_tc_rate_reads_rates_as_tc_does(text, bits_per_s):
    assert parse_tc_rate(text) == pytest.approx(bits_per_s)


def test_tc_bps_is_the_one_place_bps_means_bytes():
    assert parse_tc_rate("10mbps") == 8 * parse_tc_rate("10mbit") == 8e7
    # parse_rate reads a lower-case bps as bits (25Gbps Ethernet), tc as bytes: 8 x apart.
    assert parse_rate("10mbps") * 8 == 10e6 and parse_tc_rate("10mbps") == 80e6
    # Where both read a rate, they agree (bits = 8 x bytes).
    for text in ("100mbit", "1gbit", "1gibit", "10MBps"):
        assert parse_tc_rate(text) == pytest.approx(8 * parse_rate(text))


@pytest.mark.parametrize("unshaped", [None, "none", "None", "unlimited", "unshaped", "", "  ", "0"])
def test_parse_tc_rate_unshaped(unshaped):
    assert parse_tc_rate(unshaped) is None


@pytest.mark.parametrize("bad", ["fast", "100", "1e9", "-1mbit", "1 gigabit", "1gbit/s", "1GB/s", "1ibit",
                                 "0mbit", "0.0gbit", "10GbE"])
def test_parse_tc_rate_refuses_bad_input_naming_it(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_tc_rate(bad)


# ------------------------------------------------------------------------------------------------- parse_time
@pytest.mark.parametrize("text,seconds", [
    ("5us", 5e-6), ("5\u00b5s", 5e-6), ("5\u03bcs", 5e-6), ("1.5ms", 1.5e-3), ("20 us", 20e-6), ("3ns", 3e-9),
    ("2s", 2.0), ("2", 2.0), ("0", 0.0), ("1e-3", 1e-3), (0.25, 0.25), (0, 0.0),
])
def test_parse_time(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["5 minutes", "5Ms", "5US", "us", "-5us", -1, "fast", None, False])
def test_parse_time_refuses_bad_input_naming_it(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_time(bad)


def test_the_simulator_exports_the_same_functions():
    import megatron_tawpipe.sim as sim
    from megatron_tawpipe.sim import costmodel

    assert sim.parse_rate is costmodel.parse_rate is parse_rate
    assert sim.parse_time is costmodel.parse_time is parse_time


def test_units_is_the_bottom_layer():
    """common.units imports nothing from the package and no torch (a fresh interpreter checks)."""
    import subprocess
    import sys

    code = ("import sys, megatron_tawpipe.common.units; "
            "mods = [m for m in sys.modules if m.startswith(('megatron_tawpipe.', 'torch'))]; "
            "print(sorted(mods))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['megatron_tawpipe.common', 'megatron_tawpipe.common.units']"
