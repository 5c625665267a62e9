"""The protocol's shared pieces: one path rule for the engine and the SDK."""

from __future__ import annotations

from ironflow.protocol import lookup_path


def test_lookup_path_reads_dicts_and_list_indexes_with_or_without_a_data_prefix() -> None:
    data = {"order": {"items": [{"sku": "a"}, {"sku": "b"}]}, "id": 7}
    assert lookup_path(data, "order.items.1.sku") == "b"
    assert lookup_path(data, "event.data.order.items.0.sku") == "a"
    assert lookup_path(data, "data.id") == 7
    assert lookup_path(data, "order.items.2.sku") is None
    assert lookup_path(data, "order.items.x") is None
    assert lookup_path(data, "id.more") is None


def test_the_sdk_and_the_store_use_the_same_lookup() -> None:
    from ironflow.sdk import context
    from ironflow.store import waits

    assert context.lookup_path is waits.lookup_path is lookup_path
