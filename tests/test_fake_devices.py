"""The reader of a check script's result (tests/fake_devices.py)."""

from tests.fake_devices import json_objects, last_json_line


def test_results_are_read_past_what_gloo_writes_on_the_same_stdout():
    # as seen from a 2-process check: gloo's thread wrote between the result and print's newline
    out = ('[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n'
           '{"process": 0, "meshes": {"a": {"axes": [2, 4]}}}[Gloo] Rank 0 is connected to 1 peer ranks. '
           'Expected number of connected peer ranks is : 1\n'
           'a log line {not json}\n'
           '{"job": "pre", "losses": [0.69, {"nested": 1}]}\n')
    assert json_objects(out) == [{"process": 0, "meshes": {"a": {"axes": [2, 4]}}},
                                 {"job": "pre", "losses": [0.69, {"nested": 1}]}]
    assert last_json_line(out) == {"job": "pre", "losses": [0.69, {"nested": 1}]}
