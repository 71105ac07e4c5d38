"""Separate hosts on one machine (kvturn bench --hosts netns): P and D in network namespaces of their own, UCX over
TCP only, and the history's KV crossing D's link on a later turn."""
import json
import signal
import subprocess
import sys

import pytest

from chat import conversation
from kvturn.bench.netns import Link, Network, NetnsStack, NetnsUnavailable, hosts_for
from kvturn.bench.topology import Topology


def test_a_link_is_a_rate_and_an_optional_delay():
    link = Link.parse("25gbit:50us")
    assert link.rate_bits_per_s == 25e9 and link.delay_s == pytest.approx(50e-6)
    assert Link.parse("10gbit").delay_s == 0.0
    for bad in ("", "fast", "25gb", "25gbit:soon", "0kbit", "25gbit:5s"):
        with pytest.raises(ValueError):
            Link.parse(bad)


def test_a_topology_counts_prefill_then_decode_workers():
    assert Topology.parse("2P2D") == Topology(2, 2) and str(Topology.parse("1p3d")) == "1P3D"
    for bad in ("2P", "PD", "0P1D", "1P17D", "2P2D;rm"):
        with pytest.raises(ValueError):
            Topology.parse(bad)


@pytest.fixture(scope="module")
def network():
    try:
        with Network(hosts_for(1, 1), Link.parse("10gbit")) as made:
            yield made
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces cannot be made here: {exc}")


@pytest.mark.integration
def test_a_later_turn_reads_the_history_from_d_across_its_link(network, tiny_model_dir, tmp_path):
    stack = NetnsStack(network, tiny_model_dir, prefix_caching_on_prefill=False, kv_cache_mb=64,
                       worker_args=["--no-calibrate"], log_dir=tmp_path)
    with stack:
        assert stack.urls["prefill"] != stack.urls["decode0"] and "127.0.0.1" not in stack.url
        conversation(stack.url, 1, "netns-1")
        out_of_d = network.bytes_out_of("decode0")
        _, results = conversation(stack.url, 2, "netns-1")
        crossed = network.bytes_out_of("decode0") - out_of_d
    second = results[1]["kvturn"]
    assert second["reuse"] == "reused" and second["bytes_d_to_p"] > 0
    assert crossed >= second["bytes_d_to_p"]  # the KV left D's namespace over its veth, not through shared memory


def test_closing_the_network_removes_every_namespace_and_link(network):
    with Network(["router", "prefill"]) as other:
        names = list(other.namespaces.values())
        assert set(names) <= set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
        assert other.tag != network.tag and other.subnet != network.subnet
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert subprocess.run(["ip", "link", "show", other.bridge], capture_output=True).returncode != 0


def hold_a_network() -> subprocess.Popen:
    """A process that makes a network, prints its namespaces and waits (the bench between two legs). Ctrl-C
    interrupts it even where the suite itself runs as a background job, which starts its children ignoring SIGINT."""
    code = ("import json, signal, time\nfrom kvturn.bench.netns import Network\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "with Network(['router', 'prefill']) as n:\n"
            "    print(json.dumps([n.bridge, *n.namespaces.values()]), flush=True)\n    time.sleep(120)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def existing(names: list[str]) -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [name for name in names if name in namespaces or f" {name}:" in links]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_bench_stopped_by_a_signal_leaves_no_namespace_behind(network, sig):
    holder = hold_a_network()
    names = json.loads(holder.stdout.readline())
    assert existing(names) == names
    holder.send_signal(sig)
    holder.wait(timeout=30)
    assert existing(names) == []


def test_what_a_killed_run_left_is_removed_by_the_next(network):
    holder = hold_a_network()
    names = json.loads(holder.stdout.readline())
    holder.kill()
    holder.wait(timeout=30)
    assert existing(names) == names
    with Network(["router"]):
        assert existing(names) == []
