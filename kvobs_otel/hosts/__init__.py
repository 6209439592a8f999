"""Host adapters: where lifecycle events are observed inside a host."""
