"""Root conftest: settings shared by the plugin's own tests and the conformance suites."""

pytest_plugins = ["pytester"]

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is in the `test` extra
    pass
else:
    settings.register_profile(
        "ci",
        deadline=None,
        max_examples=25,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.register_profile("dev", deadline=None, max_examples=10)
    settings.load_profile("ci")
