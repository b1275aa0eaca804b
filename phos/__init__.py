"""phos: GPU API remoting with snapshottable contexts."""
__version__ = "0.1.0"
