"""Flow control: a fair queue in front of saturated workers (`base` holds the contract)."""
