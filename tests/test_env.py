"""``env.env_get`` reads what ``os.environ.get`` reads, through every way tests and users set it."""

import os

from flash_gdn.env import env_get


def test_env_get_follows_os_environ(monkeypatch):
    name = "FLASH_GDN_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert env_get(name) is None and env_get(name, "1") == "1"
    monkeypatch.setenv(name, "0")
    assert env_get(name, "1") == "0" == os.environ.get(name)
    os.environ[name] = "släk"  # non-ASCII round trip
    assert env_get(name) == "släk"
    del os.environ[name]
    assert env_get(name, "x") == "x"
    monkeypatch.setenv(name, "")
    assert env_get(name, "x") == ""  # set but empty is not unset
