"""Tests of bench/: metric definitions on made-up timelines, the prompt set, the run plan, one real run."""
