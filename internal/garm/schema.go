package garm

// ConfigSchema is the JSON schema of this provider's configuration file
// (GetConfigJSONSchema). The file is the executor's own TOML format
// (docs/configuration.md); the schema describes the part garm pools meet.
const ConfigSchema = `{
  "$schema": "http://json-schema.org/draft-07/schema#",
  "title": "libvirt-executor garm provider configuration (TOML, GARM_PROVIDER_CONFIG_FILE)",
  "type": "object",
  "required": ["images"],
  "properties": {
    "images": {"type": "object", "description": "[images.NAME]: the images a pool may name (see docs/configuration.md)"},
    "garm": {
      "type": "object",
      "properties": {
        "images": {"type": "array", "items": {"type": "string"}, "description": "images garm pools may use; empty: all"},
        "flavors": {
          "type": "object",
          "additionalProperties": {
            "type": "object",
            "required": ["vcpus", "memory_mib"],
            "properties": {
              "vcpus": {"type": "integer", "minimum": 1, "maximum": 64},
              "memory_mib": {"type": "integer", "minimum": 128, "maximum": 262144},
              "disk_gib": {"type": "integer", "minimum": 0, "maximum": 4096}
            },
            "additionalProperties": false
          }
        },
        "extra_specs": {"type": "array", "items": {"enum": ["vcpus", "memory_mib", "disk_gib"]}},
        "max_age": {"type": "string", "description": "Go duration, e.g. \"24h\""}
      },
      "additionalProperties": false
    }
  }
}
`

// ExtraSpecsSchema is the JSON schema of a pool's extra_specs
// (GetExtraSpecsJSONSchema): the keys an admin may permit (garm.extra_specs);
// each is also bounded by the configuration's limits.
const ExtraSpecsSchema = `{
  "$schema": "http://json-schema.org/draft-07/schema#",
  "title": "libvirt-executor garm pool extra_specs",
  "type": "object",
  "properties": {
    "vcpus": {"type": "integer", "minimum": 1, "maximum": 64},
    "memory_mib": {"type": "integer", "minimum": 128, "maximum": 262144},
    "disk_gib": {"type": "integer", "minimum": 1, "maximum": 4096}
  },
  "additionalProperties": false
}
`
