"""``evo dashboard`` over real HTTP: the key, the browser login, and a result added while it is open."""

from __future__ import annotations

import http.cookiejar
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("uvicorn")

from dashboard_testlib import KEY, dashboard  # noqa: E402
from report_testlib import add_best, evo, make_run  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("dashboard"))


def _get(opener: urllib.request.OpenerDirector, url: str, **headers: str) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers=headers)
    try:
        with opener.open(req, timeout=30) as r:
            return r.status, r.geturl(), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, url, exc.read().decode()


def test_with_a_key_a_browser_logs_in_once_and_an_api_client_sends_it(run):
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with dashboard(run) as url:
        status, landed, body = _get(browser, url)  # a browser sends no bearer header: sent to log in
        assert status == 200 and landed.endswith("/login") and 'type="password"' in body
        assert _get(browser, url + "api/report")[0] == 401
        wrong = urllib.parse.urlencode({"key": "not-it"}).encode()
        try:
            browser.open(urllib.request.Request(url + "login", data=wrong), timeout=30)
            raise AssertionError("a wrong key logged in")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        assert not list(jar)
        with browser.open(urllib.request.Request(url + "login", data=urllib.parse.urlencode({"key": KEY}).encode()),
                          timeout=30) as r:  # fmt: skip
            page = r.read().decode()
        assert '<section id="archive">' in page and 'data-plot="archive_fitness"' in page
        (cookie,) = list(jar)
        assert cookie.has_nonstandard_attr("HttpOnly") and cookie.value != KEY
        status, _, body = _get(urllib.request.build_opener(), url + "api/report", Authorization=f"Bearer {KEY}")
        assert status == 200 and json.loads(body)["changed"] is True
        stranger = urllib.request.build_opener()
        assert _get(stranger, url + "api/report", Authorization="Bearer wrong")[0] == 401
        assert _get(stranger, url + "api/report", Cookie="evo_dashboard=guess")[0] == 401


def test_a_result_recorded_after_the_page_opened_reaches_it(run):
    opener = urllib.request.build_opener()
    with dashboard(run, key=None) as url:
        first = json.loads(_get(opener, url + "api/report")[2])
        again = json.loads(_get(opener, url + f"api/report?after={first['marker']}")[2])
        assert again == {**again, "changed": False, "sections": []}  # nothing new: nothing sent
        added = add_best(run)
        deadline = time.monotonic() + 90  # it redraws at a low priority
        while True:
            got = json.loads(_get(opener, url + f"api/report?after={first['marker']}")[2])
            if got["changed"] and any(added[:16] in s["body"] for s in got["sections"]):
                break
            assert time.monotonic() < deadline, "the new best never reached the dashboard"
            time.sleep(0.5)


def test_dashboard_refuses_to_show_a_run_to_the_network_without_a_key(run, tmp_path):
    out = evo("dashboard", str(run), "--host", "0.0.0.0", cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and "--key-env" in out.stderr and "Traceback" not in out.stderr
    out = evo("dashboard", str(tmp_path / "none"), cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and "no run in" in out.stderr


def test_a_loopback_dashboard_answers_loopback_names_only_and_a_taken_port_is_one_line(run, tmp_path):
    opener = urllib.request.build_opener()
    with dashboard(run, key=None) as url:
        assert _get(opener, url + "api/report")[0] == 200
        status, _, _ = _get(opener, url + "api/report", Host="attacker.example")  # a rebound DNS name
        assert status == 400
        port = urllib.parse.urlparse(url).port
        out = evo("dashboard", str(run), "--port", str(port), cwd=tmp_path, timeout=60)
        assert out.returncode == 2 and "cannot listen" in out.stderr and "Traceback" not in out.stderr
