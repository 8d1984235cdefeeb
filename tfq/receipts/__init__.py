"""Receipts: a reply's bits and what decides them, in a document anyone can replay (`tfq replay`)."""
