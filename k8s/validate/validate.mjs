// Validate custom resources against the JSON schemas @kubernetes-models
// generates from the projects' own CRDs. Reads a JSON array of objects on
// stdin; prints one line per object ("ok KIND/NAME" or "invalid KIND/NAME:
// why"); exits 1 if any is invalid or of a kind it has no schema for.
import { DestinationRule } from "@kubernetes-models/istio/networking.istio.io/v1/DestinationRule";

const MODELS = {
  "networking.istio.io/v1/DestinationRule": DestinationRule,
};

let input = "";
for await (const chunk of process.stdin) input += chunk;
let failed = false;
for (const obj of JSON.parse(input)) {
  const name = `${obj.kind}/${obj.metadata?.name}`;
  const Model = MODELS[`${obj.apiVersion}/${obj.kind}`];
  if (!Model) {
    console.log(`unknown ${name}: no schema for ${obj.apiVersion}`);
    failed = true;
    continue;
  }
  try {
    new Model(obj).validate();
    console.log(`ok ${name}`);
  } catch (error) {
    console.log(`invalid ${name}: ${error.message}`);
    failed = true;
  }
}
process.exit(failed ? 1 : 0);
