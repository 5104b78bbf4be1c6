"""adpkv core: keys, namespaces, fragments, the shared-memory ring, the wire
protocol and the client SDK shared by the gateway and every engine adapter."""

__version__ = "0.1.0"
