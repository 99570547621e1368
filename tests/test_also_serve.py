"""--also-serve MODEL[,key=value...]: its parse, and the flags it turns into."""
import argparse

import pytest

from pagedserve.common.also_serve import parse
from pagedserve.gateway.server import also_serve_spec


def test_values_may_hold_commas_and_json():
    spec = parse('/m/bge,served-model-name=bge,text-embedding-3-small,pooler_config={"pooling_type":"MEAN",'
                 '"normalize":true},enforce-eager=true,async-scheduling=false,scheduler-address=a:1,b:2')
    assert spec.model == "/m/bge"
    assert spec.argv() == ["--served-model-name", "bge", "text-embedding-3-small",
                           '--pooler-config={"pooling_type":"MEAN","normalize":true}', "--enforce-eager",
                           "--no-async-scheduling", "--scheduler-address=a:1,b:2"]


@pytest.mark.parametrize("value, message", [
    ("", "names no model"), ("served-model-name=x", "names no model"),
    ("/m,gpu-memory-utilization=0.2,gpu_memory_utilization=0.3", "gives gpu-memory-utilization twice")])
def test_a_malformed_spec_says_what_to_write(value, message):
    with pytest.raises(ValueError, match=message):
        parse(value)


@pytest.mark.parametrize("value, message", [
    ("/m/bge", "give its schedulers as scheduler-address=A"),
    ("/m/bge,scheduler-address=a:1,gpu-memory-utilization=0.2", "unknown key gpu-memory-utilization"),
    ("/m/bge,scheduler-address=a:1,a:1", "lists an address twice")])
def test_a_gateway_takes_only_what_routing_needs(value, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        also_serve_spec(value)
