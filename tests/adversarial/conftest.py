"""The adversarial suite: hostile candidates through the real local loop (see README.md here)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "adversarial: hostile candidates run through the real local loop (tests/adversarial)")
