"""The CPU capability probe: tiers from /proc/cpuinfo flags, caches from sysfs, the override."""

import pytest

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.platforms.cpu_features import (
    IsaTier,
    missing_flags,
    parse_cpuinfo,
    probe,
    read_cache_bytes,
)

ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx fma f16c avx2 bmi2"
ZEN5 = ZEN3 + " avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni avx512vbmi"
SAPPHIRE_RAPIDS = ZEN5 + " amx_bf16 amx_tile amx_int8"
SKYLAKE_X = ZEN3 + " avx512f avx512dq avx512bw avx512vl"  # AVX-512 without BF16


def make_cpuinfo(flags: str, model: str = "Test CPU", key: str = "flags") -> str:
    processor = f"processor\t: 0\nmodel name\t: {model}\n{key}\t\t: {flags}\n\n"
    return processor + processor.replace(": 0", ": 1")


@pytest.mark.parametrize(
    ("flags", "tier"),
    [
        (SAPPHIRE_RAPIDS, IsaTier.AMX),
        (ZEN5, IsaTier.AVX512),
        (ZEN3, IsaTier.AVX2),
        (SKYLAKE_X, IsaTier.AVX2),
        ("fpu sse sse2 avx", IsaTier.NONE),
    ],
)
def test_the_tier_is_the_best_whose_flags_are_all_present(flags, tier):
    capabilities = probe(make_cpuinfo(flags), "x86_64", {})
    assert (capabilities.tier, capabilities.detected_tier) == (tier, tier)
    assert capabilities.computes_bf16 == (tier >= IsaTier.AVX512)


def test_a_cpu_that_is_not_x86_runs_the_plain_tier_whatever_its_flags():
    text = make_cpuinfo("fp asimd bf16 sve", key="Features")
    assert parse_cpuinfo(text)[1] == frozenset({"fp", "asimd", "bf16", "sve"})
    assert probe(text, "aarch64", {}).tier is IsaTier.NONE


def test_the_override_runs_a_lower_tier_and_says_what_the_cpu_has():
    capabilities = probe(make_cpuinfo(SAPPHIRE_RAPIDS, "Xeon"), "x86_64", {"KUNLUN_CPU_ISA": "AVX2"})
    assert (capabilities.tier, capabilities.detected_tier) == (IsaTier.AVX2, IsaTier.AMX)
    assert not capabilities.computes_bf16
    assert capabilities.describe()["isa_tier"] == "avx2"
    assert capabilities.describe()["detected_isa_tier"] == "amx"
    assert probe(make_cpuinfo(ZEN3), "x86_64", {"KUNLUN_CPU_ISA": "none"}).tier is IsaTier.NONE


def test_asking_for_a_tier_the_cpu_lacks_names_the_missing_flags():
    with pytest.raises(ConfigError, match=r"lacks avx512f, avx512bw.*best tier is avx2") as caught:
        probe(make_cpuinfo(ZEN3, "EPYC"), "x86_64", {"KUNLUN_CPU_ISA": "avx512"})
    assert caught.value.field == "KUNLUN_CPU_ISA"
    with pytest.raises(ConfigError, match="amx_tile, amx_bf16"):
        probe(make_cpuinfo(ZEN5), "x86_64", {"KUNLUN_CPU_ISA": "amx"})
    with pytest.raises(ConfigError, match="x86-64"):
        probe(make_cpuinfo("fp asimd", key="Features"), "aarch64", {"KUNLUN_CPU_ISA": "avx2"})
    with pytest.raises(ConfigError, match="unknown tier 'sse9'"):
        probe(make_cpuinfo(ZEN3), "x86_64", {"KUNLUN_CPU_ISA": "sse9"})


def test_missing_flags_include_the_lower_tiers():
    assert missing_flags(IsaTier.AVX512, frozenset({"avx512f"})) == [
        "avx2", "fma", "f16c", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"
    ]  # fmt: skip
    assert missing_flags(IsaTier.NONE, frozenset()) == []


def test_cache_sizes_come_from_sysfs_and_skip_the_instruction_cache(tmp_path):
    cache = tmp_path / "devices/system/cpu/cpu0/cache"
    for index, (level, kind, size) in enumerate(
        [
            ("1", "Data", "48K"),
            ("1", "Instruction", "32K"),
            ("2", "Unified", "1024K"),
            ("3", "Unified", "32M"),
        ]
    ):
        folder = cache / f"index{index}"
        folder.mkdir(parents=True)
        (folder / "level").write_text(level + "\n")
        (folder / "type").write_text(kind + "\n")
        (folder / "size").write_text(size + "\n")
    sizes = read_cache_bytes(tmp_path)
    assert sizes == {"L1d": 48 * 1024, "L2": 1024 * 1024, "L3": 32 * 1024**2}
    capabilities = probe(make_cpuinfo(ZEN3), "x86_64", {}, sizes)
    assert (capabilities.l1d_bytes, capabilities.l2_bytes, capabilities.l3_bytes) == (
        49152,
        1048576,
        33554432,
    )
    assert read_cache_bytes(tmp_path / "absent") == {}
