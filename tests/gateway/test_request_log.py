"""SEC-19: with --enable-log-requests, a request's constraint, stop strings and logit_bias are logged
cut to a few hundred characters (with their length and a hash), so that no line grows to megabytes."""
COMPLETIONS = "/v1/completions"


def _lines(capsys, event: str) -> list[str]:
    captured = capsys.readouterr()
    return [line for line in (captured.out + captured.err).splitlines() if event in line]


async def test_large_parameters_are_logged_cut(http, serve, capsys):
    url = await serve(log_requests=True)
    body = {"prompt": "hi", "max_tokens": 2, "guided_regex": "x*" + "y?" * 30_000,
            "stop": ["s" * 1024] * 4, "logit_bias": {str(t): 1 for t in range(250)}}
    async with http.post(url + COMPLETIONS, json=body) as r:
        assert r.status == 200, await r.text()
    line, = _lines(capsys, "request_finished")
    assert len(line) < 2048 and line.count("characters, sha256") == 3


async def test_a_4_mib_regex_is_not_logged_whole(http, serve, capsys):
    url = await serve(log_requests=True)
    body = ('{"prompt": "hi", "max_tokens": 1, "guided_regex": "' + "x" * 4_000_000 + '"}').encode()
    async with http.post(url + COMPLETIONS, data=body, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "guided_regex"
    assert all(len(line) < 2048 for line in _lines(capsys, "request_"))


async def test_fields_the_server_ignores_are_logged_by_name(http, base_url, capsys):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with http.post(base_url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
    assert not _lines(capsys, "request_fields_ignored")
    async with http.post(base_url + "/v1/chat/completions", json={**body, "prediction": {}, "zz": 1}) as r:
        assert r.status == 200
    line, = _lines(capsys, "request_fields_ignored")
    assert "['prediction', 'zz']" in line and "count=2" in line and "request_id=" in line
    crafted = {**body, **{f"f{i:04}": 0 for i in range(5000)}}
    async with http.post(base_url + "/v1/chat/completions", json=crafted) as r:
        assert r.status == 200
    line, = _lines(capsys, "request_fields_ignored")
    assert "count=5000" in line and len(line) < 2048


async def test_log_outputs_puts_each_output_on_the_line_cut_to_max_log_len(http, serve, capsys):
    body = {"prompt": "hi", "max_tokens": 8, "n": 2, "seed": 1}
    for options, cut in (({"log_outputs": True}, False), ({"log_outputs": True, "max_log_len": 3}, True),
                         ({}, None)):
        url = await serve(log_requests=True, **options)
        async with http.post(url + COMPLETIONS, json=body) as r:
            texts = [c["text"] for c in (await r.json())["choices"]]
        line, = _lines(capsys, "request_finished")
        if cut is None:
            assert "outputs=" not in line
        elif cut:
            assert "outputs=" in line and line.count("characters, sha256") == 2
        else:
            assert f"outputs={texts!r}" in line or all(repr(t) in line for t in texts)
