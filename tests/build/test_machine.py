"""specexport.bench.machine: the CPU named in reports."""

from __future__ import annotations

import platform

from specexport.bench import machine


def test_cpu_model_reads_the_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n"
        "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\n"
    )
    assert machine.cpu_model(info) == "Intel(R) Xeon(R) Processor"


def test_cpu_model_falls_back_without_a_model_name(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t:   \nBogoMIPS\t: 50.00\n")  # e.g. some ARM kernels
    expected = platform.processor() or platform.machine()
    assert machine.cpu_model(info) == expected
    assert machine.cpu_model(tmp_path / "absent") == expected


def test_describe_names_platform_cpu_and_cores():
    d = machine.describe()
    assert set(d) == {"platform", "cpu", "cpu_count"}
    assert d["cpu"] and isinstance(d["cpu_count"], int) and d["cpu_count"] >= 1
